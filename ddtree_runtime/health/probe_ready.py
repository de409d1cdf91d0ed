"""The live probe's first gate: the server answers /health_generate with 200 within --timeout.

Stops early where waiting cannot help: systemd gave up on the unit, or what listens on the port does not
speak HTTP. Host side: stdlib only.
"""

from __future__ import annotations

import subprocess
import sys
import time

from ddtree_runtime.health import http_client, sglang_client
from ddtree_runtime.health.http_client import HTTPFailure
from ddtree_runtime.health.probe_report import EXIT_NOT_READY, Check, Report


def progress(msg: str) -> None:
    print(f"probe: {msg}", file=sys.stderr, flush=True)


def unit_gave_up(unit: str) -> bool:
    """True once systemd stopped restarting the unit (ActiveState=failed: start limit hit)."""
    name = unit if unit.endswith(".service") else f"{unit}.service"
    try:
        out = subprocess.run(["systemctl", "show", name, "-p", "ActiveState"], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError, ValueError):
        return False
    return out.strip() == "ActiveState=failed"


def wait_ready(base: str, timeout: float, report: Report, *, poll_s: float = 2.0,
               unit: str | None = None) -> bool:
    """Poll /health_generate until 200 (SGLang answers 503 until warm-up is done).

    With `unit`, stop early once systemd has given up on it: waiting longer cannot help. Something
    on the port that does not speak HTTP fails at once (twice in a row: not a server warming up).
    """
    start = time.monotonic()
    deadline, last_note, last_state = start + timeout, start, "no answer yet"
    reached = refused_after_reached = False
    not_http = 0
    while True:
        remaining = deadline - time.monotonic()
        try:
            status = sglang_client.health_generate(base, timeout=min(30.0, max(remaining, 0.2)))
            reached, refused_after_reached, not_http = True, False, 0
            if status == 200:
                report.figures["ready_seconds"] = round(time.monotonic() - start, 3)
                report.check("ready", True, f"/health_generate 200 after {report.figures['ready_seconds']} s")
                return True
            last_state = f"HTTP {status}"
        except HTTPFailure as exc:
            last_state = str(exc).split(": ", 1)[-1]
            refused_after_reached = reached and exc.kind in (http_client.REFUSED, http_client.CLOSED)
            # a peer that accepted the connection was reached, even if it never answered properly
            reached = reached or exc.kind not in (http_client.REFUSED, http_client.UNREACHABLE)
            not_http = not_http + 1 if exc.kind in (http_client.NOT_HTTP, http_client.TOO_LARGE) else 0
            if not_http >= 2:
                detail = f"{base}/health_generate: {last_state}"
                report.checks.append(Check("ready", False, detail))
                report.fail(EXIT_NOT_READY, "not_http", f"server not usable: {detail}; check what listens "
                            f"on that port (ss -ltnp)")
                return False
        now = time.monotonic()
        gave_up = unit is not None and unit_gave_up(unit)
        if now >= deadline or gave_up:
            cause = "not_ready" if reached else "unreachable"
            detail = f"{base}/health_generate: {last_state} after {now - start:.0f} s"
            if gave_up:
                detail += f"; systemd gave up on {unit} (failed)"
            elif refused_after_reached:
                detail += " (it answered before: the server died during start-up?)"
            report.checks.append(Check("ready", False, detail))
            report.fail(EXIT_NOT_READY, cause, f"server {'not ready' if reached else 'not reachable'}: "
                        f"{detail}; name the cause: ddtree diagnose --unit {unit or 'UNIT'}")
            return False
        if now - last_note >= 10:
            progress(f"waiting for {base} to be ready: {last_state} ({now - start:.0f} of {timeout:g} s)")
            last_note = now
        time.sleep(min(poll_s, max(0.0, deadline - now)))
