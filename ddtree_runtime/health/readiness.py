"""Is the server ready? The one readiness poller: SGLang answers ``/health_generate`` 503 until its warm-up is
done, then 200.

Three callers ask it: the service role after a restart (``roles/sglang_service/tasks/wait.yml`` ships this
file alone to the host and runs it as a script), the live probe's first gate (``probe_ready``) and the
canary's two sides (``canary``). Standard library only, no package import: the role runs it where the
package may not be importable.

The rule, one for all: poll until 200 or the timeout; stop early when what answers is not HTTP twice in a
row (another service on the port), or when the unit is down. A unit ``just_restarted`` by the caller is down
once it failed, stopped, or crashed and is being restarted, and counts as ready only while active; a unit
that was running is down only once systemd gave up on it (failed). ``stable`` seconds after the first 200
the unit must still be up and answer again (a server that dies right after its first answer is not ready).

As a script: ``readiness.py --unit U --url BASE --timeout S [--stable S] [--since EPOCH]`` prints one JSON
object and exits 0 (ready), 1 (the unit is down, or not HTTP) or 3 (still not ready at the timeout).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

PATH = "/health_generate"
# The kinds of failure that http_client.HTTPFailure names (tests/unit/test_readiness.py keeps them equal).
REFUSED, CLOSED, NOT_HTTP, TOO_LARGE, UNREACHABLE = (
    "refused", "closed", "not_http", "too_large", "unreachable",
)  # fmt: skip
EXIT_READY, EXIT_DOWN, EXIT_TIMEOUT = 0, 1, 3
_PROPERTIES = ("ActiveState", "SubState", "Result", "NRestarts", "ExecMainStatus", "ExecMainCode")
NOTE_EVERY_S = 10.0


@dataclass
class Readiness:
    """What the wait found. ``cause``: ready, unit_down, not_http or timeout."""

    ready: bool
    cause: str
    reason: str | None
    waited_s: float
    last: str = "no answer yet"  # the last answer: "HTTP 503", "connection refused (...)", ...
    reached: bool = False  # something at the address took the connection
    answered_before: bool = False  # it answered, then refused or closed: died during start-up?
    ready_s: float | None = None  # seconds to the first 200
    state: dict[str, str] = field(default_factory=dict)  # the unit as systemd last showed it


def ask_stdlib(base: str, *, timeout: float) -> int:
    """The status of ``GET {base}/health_generate``: HTTP error statuses returned, no answer OSError."""
    try:
        with urllib.request.urlopen(base + PATH, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def unit_state(unit: str) -> dict[str, str]:
    """The unit's properties as ``systemctl show`` gives them; {} when systemd cannot be asked."""
    name = unit if unit.endswith(".service") else f"{unit}.service"
    try:
        out = subprocess.run(["systemctl", "show", name, "--property=" + ",".join(_PROPERTIES)],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def down_reason(state: dict[str, str], *, just_restarted: bool) -> str | None:
    """Why waiting longer cannot help, or None."""
    if state.get("ActiveState") == "failed":
        return f"unit failed (Result={state.get('Result')}, exit status {state.get('ExecMainStatus')})"
    if not just_restarted:
        return None
    if not state:
        return "cannot read the unit's state (systemctl show failed)"
    if state.get("SubState") == "auto-restart" or int(state.get("NRestarts") or 0) > 0:
        return f"unit crashed and is being restarted (exit status {state.get('ExecMainStatus')})"
    if state.get("ActiveState") in ("inactive", "deactivating"):
        return "unit stopped"
    return None


def wait(base: str, timeout: float, *, ask: Callable[..., int] = ask_stdlib, unit: str | None = None,
         just_restarted: bool = False, interval: float = 2.0, stable: float = 0.0,
         note: Callable[[str], None] | None = None,
         state_of: Callable[[str], dict[str, str]] = unit_state) -> Readiness:
    """Poll ``{base}/health_generate`` until 200 (see the module's rule). ``ask(base, timeout=...)`` returns
    the status or raises OSError, whose ``kind`` (http_client's) says what happened where it has one."""
    start = time.monotonic()
    deadline, last_note = start + timeout, start
    found = Readiness(False, "timeout", None, 0.0)
    not_http = 0
    while True:
        if unit is not None:
            found.state = state_of(unit)
            reason = down_reason(found.state, just_restarted=just_restarted)
            if reason:
                return _end(found, start, "unit_down", reason)
        try:
            status = ask(base, timeout=min(30.0, max(deadline - time.monotonic(), 0.2)))
            found.reached, found.answered_before, not_http = True, False, 0
            active = not just_restarted or found.state.get("ActiveState") == "active"
            if status == 200 and active:
                found.ready_s = round(time.monotonic() - start, 3)
                return _hold(found, base, start, ask, unit, stable, interval, state_of)
            # 200 while the unit restarted is not yet active is not ready either
            shown = found.state.get("ActiveState")
            found.last = f"HTTP {status}" + (f", unit {shown}" if status == 200 else "")
        except OSError as exc:
            kind = getattr(exc, "kind", "")
            found.last = str(getattr(exc, "reason", exc)).split(": ", 1)[-1]
            found.answered_before = found.reached and kind in (REFUSED, CLOSED)
            # a peer that took the connection was reached, even if it never answered properly
            found.reached = found.reached or kind not in (REFUSED, UNREACHABLE, "")
            not_http = not_http + 1 if kind in (NOT_HTTP, TOO_LARGE) else 0
            if not_http >= 2:
                return _end(found, start, "not_http", f"{base}{PATH}: {found.last}")
        now = time.monotonic()
        if now >= deadline:
            return _end(found, start, "timeout", f"not ready after {timeout:.0f} s (start_timeout): "
                        f"{found.last}")
        if note is not None and now - last_note >= NOTE_EVERY_S:
            note(f"waiting for {base} to be ready: {found.last} ({now - start:.0f} of {timeout:g} s)")
            last_note = now
        time.sleep(min(interval, max(0.0, deadline - now)))


def _end(found: Readiness, start: float, cause: str, reason: str) -> Readiness:
    found.cause, found.reason, found.waited_s = cause, reason, round(time.monotonic() - start, 1)
    return found


def _hold(found: Readiness, base: str, start: float, ask: Callable[..., int], unit: str | None,
          stable: float, interval: float, state_of: Callable[[str], dict[str, str]]) -> Readiness:
    """Ready: watch the unit for ``stable`` seconds more, then ask once again."""
    found.ready, found.cause, found.waited_s = True, "ready", round(time.monotonic() - start, 1)
    until = time.monotonic() + stable
    while unit is not None and time.monotonic() < until:
        time.sleep(min(interval, max(0.0, until - time.monotonic())))
        found.state = state_of(unit)
        reason = down_reason(found.state, just_restarted=True)
        if reason:
            after = time.monotonic() - until + stable
            found.ready = False
            return _end(found, start, "unit_down", f"{reason} {after:.0f} s after it was ready")
    if stable > 0:
        try:
            answered = ask(base, timeout=30.0) == 200
        except OSError:
            answered = False
        if not answered:
            found.ready = False
            return _end(found, start, "unit_down",
                        f"stopped answering within {stable:.0f} s after it was ready")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unit", required=True)
    parser.add_argument("--url", required=True, help="the server's base URL")
    parser.add_argument("--timeout", type=float, required=True, help="seconds")
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--stable", type=float, default=0.0, help="seconds the unit must stay up once ready")
    parser.add_argument("--since", default="", help="host clock at the restart (for the report)")
    args = parser.parse_args()
    found = wait(args.url.rstrip("/"), args.timeout, ask=ask_stdlib, unit=args.unit, just_restarted=True,
                 interval=args.interval, stable=args.stable, state_of=unit_state)
    print(json.dumps({"unit": args.unit, "url": args.url + PATH, "since": args.since,
                      "stable_s": args.stable, **asdict(found)}))
    return EXIT_READY if found.ready else EXIT_TIMEOUT if found.cause == "timeout" else EXIT_DOWN


if __name__ == "__main__":
    sys.exit(main())
