"""A loopback server that answers the probe's endpoints as badly as asked: garbage, drips, hangs, resets,
huge bodies, wrongly typed JSON, or a death between two requests. For the live probe's fuzz suite.

Each path maps to a behaviour (a callable that gets the connection and the request). Anything not
mapped answers 404. `die_after=N` closes the listening socket after N requests: the next connection is
refused, as when a server crashes between two requests.
"""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from typing import Any

Behaviour = Callable[["_Handler"], None]


def respond(status: int, body: bytes | str | Any, ctype: str = "application/json") -> Behaviour:
    if isinstance(body, bytes):
        data = body
    else:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()

    def send(h: _Handler) -> None:
        h.send_raw(b"HTTP/1.1 %d X\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                   % (status, ctype.encode(), len(data)) + data)
    return send


def raw(data: bytes) -> Behaviour:
    return lambda h: h.send_raw(data)


def close(h: _Handler) -> None:
    """Accept, read the request, hang up without a word."""


def reset(h: _Handler) -> None:
    h.request.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")


def drip(inner: Behaviour, delay: float = 0.1) -> Behaviour:
    """What `inner` would send, one byte every `delay` seconds."""
    def send(h: _Handler) -> None:
        captured = bytearray()
        inner(_Capture(captured))
        for b in bytes(captured):
            if h.server.stopping.wait(delay):
                return
            h.send_raw(bytes([b]))
    return send


def hang(h: _Handler) -> None:
    h.server.stopping.wait(60)


def endless(h: _Handler) -> None:
    """A 200 whose chunked body never ends (until the client gives up)."""
    h.send_raw(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"10000\r\n" + b"x" * 0x10000 + b"\r\n"
    while not h.server.stopping.is_set():
        h.send_raw(chunk)


class _Capture:
    def __init__(self, sink: bytearray) -> None:
        self.sink = sink

    def send_raw(self, data: bytes) -> None:
        self.sink.extend(data)


class _Handler(socketserver.BaseRequestHandler):
    server: HostileServer

    def send_raw(self, data: bytes) -> None:
        with contextlib.suppress(OSError):
            self.request.sendall(data)

    def handle(self) -> None:
        self.request.settimeout(5)
        try:
            fh = self.request.makefile("rb")
            line = fh.readline(65536).decode(errors="replace")
            length = 0
            while True:
                header = fh.readline(65536)
                if header in (b"\r\n", b"\n", b""):
                    break
                name, _, value = header.decode(errors="replace").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip() or 0)
            body = fh.read(length) if length else b""
        except (OSError, ValueError):
            return
        parts = line.split()
        path = parts[1].split("?", 1)[0] if len(parts) >= 2 else ""
        srv = self.server
        with srv.lock:
            srv.seen.append((path, body))
            srv.count += 1
            die = srv.die_after is not None and srv.count >= srv.die_after
        if die:  # refuse connections before this answer goes out: the client's next request finds no server
            srv.die()
        srv.routes.get(path, respond(404, {"detail": "Not Found"}))(self)


class HostileServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, routes: dict[str, Behaviour], *, die_after: int | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.routes = routes
        self.die_after = die_after
        self.count = 0
        self.seen: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self._thread = threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True)
        self._dead = False

    def die(self) -> None:
        if not self._dead:
            self._dead = True
            self.socket.shutdown(socket.SHUT_RDWR)  # Linux: the listener stops, the next connect is refused
            threading.Thread(target=self.shutdown, daemon=True).start()

    def __enter__(self) -> HostileServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        if not self._dead:
            self.shutdown()
        self.server_close()
        time.sleep(0)  # let handler threads see `stopping`
