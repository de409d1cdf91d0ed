"""One SSH exchange with a fleet host (ssh_session, paramiko) and, when it fails, one line saying why in
the operator's terms (key changed, key unknown, refused, timed out, ...)."""

from __future__ import annotations

import socket
from typing import Any

from ddtree_runtime.ops.fleet_inventory import Target


def why_unreachable(t: Target, exc: BaseException) -> str:
    import paramiko

    from ddtree_runtime.ops.ssh_session import AnswerTooLarge, DeadlineExceeded, KeyFileError

    where = f"{t.user}@{t.address}:{t.port}"
    if isinstance(exc, DeadlineExceeded):
        return (f"{where}: timed out: no complete answer within {t.timeout:g} s (host silent, dripping or "
                "overloaded; --timeout bounds the whole exchange)")
    if isinstance(exc, AnswerTooLarge):
        return f"{where}: {exc}: not an answer of ours"
    if isinstance(exc, KeyFileError):
        return f"{where}: {exc}"
    if isinstance(exc, paramiko.BadHostKeyException):
        return (f"{where}: host key CHANGED (expected {exc.expected_key.get_base64()[:16]}...): "
                "if the host was rebuilt, remove its old key from known_hosts; otherwise do not connect")
    if isinstance(exc, paramiko.SSHException) and "not found in known_hosts" in str(exc):
        files = ", ".join(t.known_hosts) or "~/.ssh/known_hosts"
        return (f"{where}: host key unknown and StrictHostKeyChecking={t.strict}: "
                f"check the key and add it to {files} (ssh-keyscan -p {t.port} {t.address})")
    if isinstance(exc, paramiko.AuthenticationException):
        return f"{where}: authentication refused for key {t.key_file or '(agent/default keys)'}"
    if isinstance(exc, paramiko.SSHException) and "banner" in str(exc).lower():
        return (f"{where}: no SSH banner (the port answers but does not speak SSH: a wrong port, or an sshd "
                "that is stuck)")
    if isinstance(exc, EOFError | ConnectionResetError) or (
            isinstance(exc, paramiko.SSHException) and "reset" in str(exc).lower()):
        return f"{where}: the connection was closed during the SSH handshake"
    if isinstance(exc, socket.timeout | TimeoutError):
        return f"{where}: timed out after {t.timeout:g} s (host down or filtered?)"
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        errors = list(exc.errors.values())  # one per address tried; refused is the telling one
        exc = next((e for e in errors if isinstance(e, ConnectionRefusedError)), errors[0] if errors else exc)
    if isinstance(exc, ConnectionRefusedError):
        return f"{where}: connection refused (sshd not running?)"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{where}: {exc.strerror}"
    return f"{where}: {type(exc).__name__}: {exc}"


def open_client(t: Target) -> Any:
    """A logged-in paramiko client for more than one command (e.g. SFTP); the caller closes it."""
    from ddtree_runtime.ops import ssh_session

    return ssh_session.connect(address=t.address, port=t.port, user=t.user, key_file=t.key_file,
                               known_hosts=t.known_hosts, strict=t.strict, timeout=t.timeout)


def run_remote(t: Target, command: str, stdin_text: str | None = None) -> tuple[int, str, str]:
    """Run one command on the target, the whole exchange within ``t.timeout`` seconds; raises on
    connection problems and at the deadline (ssh_session.DeadlineExceeded)."""
    from ddtree_runtime.ops import ssh_session

    if t.become and t.user != "root":
        command = f"sudo -n {command}"  # journal and unit state as root, never prompting
    return ssh_session.run(address=t.address, port=t.port, user=t.user, key_file=t.key_file,
                           known_hosts=t.known_hosts, strict=t.strict, command=command,
                           stdin_text=stdin_text, deadline_s=t.timeout)
