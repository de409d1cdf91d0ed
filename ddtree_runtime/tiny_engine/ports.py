"""Ports for lab and test servers started side by side, held until the server is gone.

Binding port 0 and closing the socket names a port that is free *now*; a server started with it binds
it seconds later, and so may another server started at the same time with the same answer. SGLang
draws its distributed-init port (``--nccl-port``, the TCPStore of torch.distributed) the same way when
it is not given: of seven lab servers started at once, one died on EADDRINUSE there.

``lease_ports(n)`` hands out ports below the kernel's ephemeral range (so no ``bind(0)`` and no
outgoing connection is given them), each one free when drawn and locked with ``flock`` on a file of
its own in a per-user folder: every allocator of this module, in this process or another, skips a
locked port until the lease is released (``release()``, or the process ends: the kernel drops the
lock with the file descriptor). Pass every port a server binds (``--port`` and ``--nccl-port``).
Stdlib only.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import socket
import tempfile
from pathlib import Path
from typing import IO

LOW = 20000  # above the well-known services a lab host runs
ATTEMPTS = 512


def ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _lock_dir() -> Path:
    path = Path(tempfile.gettempdir()) / f"ddtree-ports-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def _free_now(port: int) -> bool:
    """Nothing listens or is bound there, on IPv4 (SGLang's TCPStore binds 0.0.0.0) nor loopback."""
    for host in ("0.0.0.0", "127.0.0.1"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


class PortLease:
    """Ports held for one server; ``release()`` when it has stopped (idempotent)."""

    def __init__(self, ports: list[int], locks: list[IO[bytes]]) -> None:
        self.ports = tuple(ports)
        self._locks = locks

    def release(self) -> None:
        for lock in self._locks:
            lock.close()  # drops the flock
        self._locks = []

    def __enter__(self) -> PortLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _try_lock(port: int) -> IO[bytes] | None:
    lock = open(_lock_dir() / f"{port}.lock", "ab")  # noqa: SIM115 (held open: the lease is the lock)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        lock.close()
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return None
        raise
    return lock


def lease_ports(n: int = 1, *, low: int = LOW, high: int | None = None,
                rng: random.Random | None = None) -> PortLease:
    """``n`` distinct ports in [low, high] (default: up to the ephemeral range), each free when drawn
    and locked against every other lease until released. RuntimeError when none is left to draw."""
    top = (ephemeral_low() - 1) if high is None else high
    if high is None and top - low + 1 < 1024:  # an ephemeral range reaching down here: draw above it
        low, top = max(low, top + 1), 65535
    if top - low + 1 < n:
        raise RuntimeError(f"no room for {n} ports in [{low}, {top}] (the ephemeral range starts above)")
    draw = rng or random.SystemRandom()
    ports: list[int] = []
    locks: list[IO[bytes]] = []
    candidates = draw.sample(range(low, top + 1), min(ATTEMPTS, top - low + 1))
    for port in candidates:
        if len(ports) == n:
            break
        lock = _try_lock(port)
        if lock is None:
            continue
        if not _free_now(port):  # bound by something that is not ours
            lock.close()
            continue
        ports.append(port)
        locks.append(lock)
    if len(ports) < n:
        PortLease(ports, locks).release()
        raise RuntimeError(f"found {len(ports)} of {n} free ports in [{low}, {top}] after "
                           f"{len(candidates)} tries")
    return PortLease(ports, locks)
