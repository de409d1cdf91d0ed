"""One SSH exchange with a fleet host under one deadline, and host keys remembered without losing any.

Controller side (paramiko). ``run(target-ish, command, stdin, deadline_s)`` connects over a socket of its
own, so a watchdog can close it at the deadline: a host that accepts the command and says nothing, or
drips a byte a second, cannot hold the caller past it (paramiko's own timeouts restart with every byte).
The answer is capped in size. ``AcceptNew`` is OpenSSH's StrictHostKeyChecking=accept-new: a first-seen
key is added to the known_hosts file under a lock (threads and processes), by re-reading the file and
replacing it atomically, so eight new hosts at once all land in it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import tempfile
import threading
import time
from typing import Any

import paramiko

MAX_ANSWER_BYTES = 16 * 1024 * 1024

# paramiko logs a failed handshake (no banner, a reset) with its traceback; the caller names the cause in
# its own words, so its log stays quiet.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger("paramiko").propagate = False

_KNOWN_HOSTS_LOCK = threading.Lock()


class DeadlineExceeded(TimeoutError):
    """The whole exchange took longer than its deadline (the host was cut off)."""


class AnswerTooLarge(ValueError):
    """The host sent more than MAX_ANSWER_BYTES."""


class KeyFileError(ValueError):
    """The inventory's private key cannot be used (missing, unreadable, passphrase-protected)."""


def _load_key(path: str) -> paramiko.PKey:
    """The key itself, so that a refused login is reported as one (with key_filename paramiko tries each
    key type in turn and reports the last type's parse error instead)."""
    try:
        return paramiko.PKey.from_path(path)
    except paramiko.PasswordRequiredException:
        raise KeyFileError(f"the private key {path} needs a passphrase: load it into ssh-agent") from None
    except (OSError, paramiko.SSHException, ValueError) as exc:
        raise KeyFileError(f"cannot read the private key {path}: {exc}") from None


def remember_host_key(path: str, hostname: str, key: paramiko.PKey) -> None:
    """Add ``hostname``'s key to the known_hosts file at ``path``, keeping every entry already there."""
    with _KNOWN_HOSTS_LOCK:
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        with open(f"{path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # other `ddtree fleet` processes
            keys = paramiko.HostKeys()
            if os.path.exists(path):
                keys.load(path)
            if keys.check(hostname, key):
                return
            keys.add(hostname, key.get_name(), key)
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=".known_hosts.")
            os.close(fd)
            try:
                keys.save(tmp)
                os.chmod(tmp, 0o600)
                os.replace(tmp, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)


class AcceptNew(paramiko.MissingHostKeyPolicy):
    """Trust a host seen for the first time and remember it; a changed key is still refused (paramiko
    raises BadHostKeyException before asking the policy)."""

    def __init__(self, known_hosts: str | None) -> None:
        self.known_hosts = known_hosts

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        client.get_host_keys().add(hostname, key.get_name(), key)
        if self.known_hosts:
            remember_host_key(self.known_hosts, hostname, key)


def connect(
    *,
    address: str,
    port: int,
    user: str,
    key_file: str | None,
    known_hosts: tuple[str, ...],
    strict: str,
    timeout: float,
    sock: socket.socket | None = None,
) -> paramiko.SSHClient:
    """A logged-in client with the inventory's host-key policy (the caller closes it)."""
    client = paramiko.SSHClient()
    client.load_system_host_keys()
    for path in known_hosts:
        if os.path.exists(path):
            client.get_host_keys().load(path)  # not load_host_keys: paramiko would rewrite the file itself
    if strict == "no":
        client.set_missing_host_key_policy(paramiko.WarningPolicy())
    elif strict == "accept-new":
        client.set_missing_host_key_policy(AcceptNew(known_hosts[0] if known_hosts else None))
    else:
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
    try:
        # An sshd sends its banner at once: a port silent for half the time left does not speak SSH, which
        # the caller can name (paramiko's "Error reading SSH protocol banner") before a deadline cuts it.
        client.connect(address, port=port, username=user, pkey=_load_key(key_file) if key_file else None,
                       sock=sock, timeout=timeout, banner_timeout=max(0.05, timeout / 2),
                       auth_timeout=timeout, look_for_keys=key_file is None, allow_agent=key_file is None)
    except BaseException:
        client.close()
        raise
    return client


def run(
    *,
    address: str,
    port: int,
    user: str,
    key_file: str | None,
    known_hosts: tuple[str, ...],
    strict: str,
    command: str,
    stdin_text: str | None,
    deadline_s: float,
) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of one command; raises DeadlineExceeded past ``deadline_s`` seconds for
    the whole exchange (connect, handshake, authentication, command, answer), else paramiko's or the
    socket's own errors."""
    started = time.monotonic()
    expired = threading.Event()
    sock: socket.socket | None = None
    client: paramiko.SSHClient | None = None

    def cut_off() -> None:
        expired.set()
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    watchdog = threading.Timer(deadline_s, cut_off)
    watchdog.daemon = True
    watchdog.start()
    try:
        sock = socket.create_connection((address, port), timeout=max(0.1, deadline_s))
        left = max(0.1, deadline_s - (time.monotonic() - started))
        client = connect(address=address, port=port, user=user, key_file=key_file, known_hosts=known_hosts,
                         strict=strict, timeout=left, sock=sock)
        stdin, stdout, _stderr = client.exec_command(command)
        if stdin_text is not None:
            stdin.write(stdin_text)
        stdin.channel.shutdown_write()
        channel = stdout.channel
        out = _read_capped(channel, stderr=False)
        err = _read_capped(channel, stderr=True)
        left = deadline_s - (time.monotonic() - started)
        if expired.is_set() or not channel.status_event.wait(max(0.0, left)):
            raise DeadlineExceeded(deadline_s)
        return channel.exit_status, out, err
    except Exception as exc:
        if expired.is_set():
            raise DeadlineExceeded(deadline_s) from exc
        raise
    finally:
        watchdog.cancel()
        if client is not None:
            client.close()
        if sock is not None:
            sock.close()


def _read_capped(channel: Any, *, stderr: bool) -> str:
    recv = channel.recv_stderr if stderr else channel.recv
    chunks, total = [], 0
    while True:
        data = recv(65536)
        if not data:
            break
        total += len(data)
        if total > MAX_ANSWER_BYTES:
            raise AnswerTooLarge(f"the host sent more than {MAX_ANSWER_BYTES >> 20} MiB")
        chunks.append(data)
    return b"".join(chunks).decode(errors="replace")
