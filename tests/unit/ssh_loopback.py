"""SSH servers on loopback (paramiko's server side) that answer `ddtree fleet` as well or as badly as asked.

Each host has a host key of its own and takes one client key. What it does with a command:

- ``run``: runs it here (the fact script `fleet` sends on stdin, with this machine's python3), as a host
  would; ``answer``: sends a fixed stdout (a lie, when the test wants one);
- ``silent``: takes the command and never answers; ``drip``: sends an answer one byte every ``delay`` s;
- ``refuse_auth``: refuses every key.

``no_banner()`` is a TCP port that accepts and never speaks SSH. The lab (tests/lab) covers real sshd.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paramiko


def new_key() -> paramiko.ECDSAKey:
    return paramiko.ECDSAKey.generate(bits=256)


def client_key(directory: Path) -> tuple[paramiko.ECDSAKey, Path]:
    key = new_key()
    path = directory / "id_ecdsa"
    key.write_private_key_file(str(path))
    return key, path


class _Server(paramiko.ServerInterface):
    def __init__(self, host: SSHHost) -> None:
        self.host = host
        self.command: bytes | None = None
        self.got_command = threading.Event()

    def check_channel_request(self, kind: str, chanid: int) -> int:
        return (
            paramiko.OPEN_SUCCEEDED if kind == "session" else paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED
        )

    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        if self.host.mode != "refuse_auth" and key == self.host.accepts:
            return paramiko.AUTH_SUCCESSFUL
        return paramiko.AUTH_FAILED

    def check_channel_exec_request(self, channel: paramiko.Channel, command: bytes) -> bool:
        self.command = command
        self.got_command.set()
        return True


class SSHHost:
    """One loopback SSH host; ``with SSHHost(...) as h: h.port``."""

    def __init__(
        self, accepts: paramiko.PKey, mode: str = "run", *, answer: str = "", delay: float = 1.0
    ) -> None:
        self.accepts, self.mode, self.answer, self.delay = accepts, mode, answer, delay
        self.host_key = new_key()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stop = threading.Event()
        self.commands: list[str] = []
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> SSHHost:
        thread = threading.Thread(target=self._accept, daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.listener.close()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        transport = paramiko.Transport(conn)
        transport.add_server_key(self.host_key)
        server = _Server(self)
        with contextlib.suppress(Exception):
            transport.start_server(server=server)
            channel = transport.accept(timeout=10)
            if channel is None or not server.got_command.wait(10):
                return
            self.commands.append(server.command.decode(errors="replace"))
            self._answer(channel, server.command.decode(errors="replace"))
        with contextlib.suppress(Exception):
            self.stop.wait(0.2)
            transport.close()

    def _stdin(self, channel: paramiko.Channel) -> bytes:
        data = bytearray()
        while chunk := channel.recv(65536):
            data.extend(chunk)
        return bytes(data)

    def _answer(self, channel: paramiko.Channel, command: str) -> None:
        stdin = self._stdin(channel)
        if self.mode == "silent":
            self.stop.wait(120)
            return
        if self.mode == "drip":
            for byte in self.answer.encode():
                if self.stop.wait(self.delay):
                    return
                channel.sendall(bytes([byte]))
            channel.send_exit_status(0)
            return
        if self.mode == "run":
            words = command.split()
            assert words[:2] == ["python3", "-"], command  # the only command fleet status sends
            done = subprocess.run(
                [sys.executable, "-", *words[2:]], input=stdin, capture_output=True, timeout=60
            )
            out, status = done.stdout, done.returncode
        else:
            out, status = self.answer.encode(), 0
        channel.sendall(out)
        channel.send_exit_status(status)


@contextlib.contextmanager
def no_banner() -> Iterator[int]:
    """A port that accepts connections and says nothing."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[Any] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        listener.close()
        for conn in held:
            conn.close()
