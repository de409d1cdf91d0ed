"""One HTTP exchange with a deadline that holds: the probes' client (host side, stdlib only).

urllib's ``timeout`` bounds each socket operation, not the exchange, so a peer that drips one byte a
second keeps a request alive for ever. Here a watchdog thread shuts the socket down when the
exchange's total deadline passes, whatever the peer does; bodies are capped; every failure is one
:class:`HTTPFailure` (an ``OSError``, so callers that caught urllib's errors keep working) whose
``kind`` names what happened and whose message says it in one line.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import socket
import threading
import time
import urllib.parse

MAX_BODY_BYTES = 16 * 1024 * 1024  # a /server_info or /metrics answer is a few KB; /generate a few hundred

# HTTPFailure.kind
REFUSED, TIMEOUT, CLOSED, NOT_HTTP, TOO_LARGE, UNREACHABLE = (
    "refused", "timeout", "closed", "not_http", "too_large", "unreachable",
)  # fmt: skip


class HTTPFailure(OSError):
    """No usable HTTP answer; ``kind``: refused, timeout, closed, not_http, too_large, unreachable."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.reason = message  # urllib.error.URLError's attribute, for callers written against urllib

    def __str__(self) -> str:
        return self.reason


def check_base_url(url: str) -> str:
    """The URL without a trailing slash; ValueError saying what is wrong with it."""
    base = url.rstrip("/")
    if not base.isascii() or not base.isprintable() or " " in base:
        raise ValueError(f"{url!r} is not a valid URL (spaces, control or non-ASCII characters)")
    try:
        parts = urllib.parse.urlsplit(base)
        port = parts.port  # raises ValueError for a port out of range or not a number
    except ValueError as exc:
        raise ValueError(f"{url!r} is not a valid URL ({exc}); pass e.g. http://127.0.0.1:30000") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL; pass e.g. http://127.0.0.1:30000")
    if port == 0:
        raise ValueError(f"{url!r}: port 0 is not a port a server listens on")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r}: pass the server's base URL, without a query or fragment")
    return base


def request(url: str, *, payload: object = None, timeout: float, max_bytes: int = MAX_BODY_BYTES,
            ) -> tuple[int, bytes]:
    """(status, body) of a GET, or a POST of ``payload`` as JSON; HTTP error statuses are returned.

    The whole exchange (connect, send, headers, body) ends within ``timeout`` seconds.
    """
    if not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    parts = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname or "", parts.port, timeout=timeout)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    body = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/plain, */*"}
    done, expired = threading.Event(), threading.Event()
    watchdog = threading.Thread(target=_watch, args=(conn, time.monotonic() + timeout, done, expired),
                                name="http-deadline", daemon=True)
    watchdog.start()
    where = f"{'POST' if body is not None else 'GET'} {url}"
    connected = False
    try:
        conn.connect()
        connected = True
        conn.request("POST" if body is not None else "GET", path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read(max_bytes + 1)
        if expired.is_set():  # the shutdown may look like a short but well-formed answer: it is not one
            raise HTTPFailure(TIMEOUT, f"{where}: no complete answer within {timeout:g} s")
        if len(data) > max_bytes:
            raise HTTPFailure(TOO_LARGE, f"{where}: the answer is larger than {max_bytes} bytes")
        return resp.status, data
    except HTTPFailure:
        raise
    except Exception as exc:  # every way an exchange can end is named in _failure
        if not connected and isinstance(exc, TimeoutError | socket.timeout):
            raise HTTPFailure(UNREACHABLE, f"{where}: no connection within {timeout:g} s") from None
        raise _failure(exc, where, timeout, expired.is_set()) from None
    finally:
        done.set()
        conn.close()


def _watch(conn: http.client.HTTPConnection, deadline: float, done: threading.Event,
           expired: threading.Event) -> None:
    """At the deadline, shut the socket: a blocked read returns at once, however slowly the peer drips."""
    while not done.wait(max(0.0, deadline - time.monotonic())):
        expired.set()
        sock = conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            return
        deadline = time.monotonic() + 0.05  # still connecting: connect() has its own timeout


def _failure(exc: Exception, where: str, timeout: float, expired: bool) -> HTTPFailure:
    if expired or isinstance(exc, TimeoutError | socket.timeout):
        return HTTPFailure(TIMEOUT, f"{where}: no complete answer within {timeout:g} s")
    if isinstance(exc, ConnectionRefusedError):
        return HTTPFailure(REFUSED, f"{where}: connection refused (nothing listens there)")
    if isinstance(exc, http.client.RemoteDisconnected | ConnectionResetError | BrokenPipeError
                  | http.client.IncompleteRead):
        return HTTPFailure(CLOSED, f"{where}: the server closed the connection without a complete answer")
    if isinstance(exc, http.client.HTTPException):
        shown = repr(str(exc)[:80])  # the peer's bytes, printable and on one line
        return HTTPFailure(NOT_HTTP, f"{where}: the answer is not HTTP ({type(exc).__name__}: {shown}): "
                                     "is another service on this port?")
    if isinstance(exc, socket.gaierror):
        return HTTPFailure(UNREACHABLE, f"{where}: cannot resolve the host name ({exc.strerror})")
    if isinstance(exc, OSError):
        return HTTPFailure(UNREACHABLE, f"{where}: {exc.strerror or exc}")
    return HTTPFailure(NOT_HTTP, f"{where}: unusable answer ({type(exc).__name__}: {str(exc)[:80]!r})")
