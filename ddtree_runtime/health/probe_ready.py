"""The live probe's first gate: the server answers /health_generate with 200 within --timeout.

The waiting is readiness.wait's (the one poller: it stops early when systemd gave up on the unit, or when
what listens on the port does not speak HTTP); this module turns what it found into the probe's check and
cause. Host side: stdlib only.
"""

from __future__ import annotations

import sys

from ddtree_runtime.health import readiness, sglang_client
from ddtree_runtime.health.probe_report import EXIT_NOT_READY, Check, Report


def progress(msg: str) -> None:
    print(f"probe: {msg}", file=sys.stderr, flush=True)


def wait_ready(base: str, timeout: float, report: Report, *, poll_s: float = 2.0,
               unit: str | None = None) -> bool:
    """Wait for /health_generate 200 (SGLang answers 503 until warm-up is done); False with the report
    failed (not_ready, unreachable or not_http) when it does not come."""
    found = readiness.wait(base, timeout, ask=sglang_client.health_generate, unit=unit,
                           interval=poll_s, note=progress)
    if found.ready:
        report.figures["ready_seconds"] = found.ready_s
        report.check("ready", True, f"/health_generate 200 after {found.ready_s} s")
        return True
    if found.cause == "not_http":
        detail = found.reason
        report.checks.append(Check("ready", False, detail))
        report.fail(EXIT_NOT_READY, "not_http", f"server not usable: {detail}; check what listens on that "
                    "port (ss -ltnp)")
        return False
    detail = f"{base}{readiness.PATH}: {found.last} after {found.waited_s:.0f} s"
    if found.cause == "unit_down":
        detail += f"; systemd gave up on {unit} (failed)"
    elif found.answered_before:
        detail += " (it answered before: the server died during start-up?)"
    cause = "not_ready" if found.reached else "unreachable"
    report.checks.append(Check("ready", False, detail))
    said = "not ready" if found.reached else "not reachable"
    report.fail(EXIT_NOT_READY, cause, f"server {said}: {detail}; name the cause: ddtree diagnose --unit "
                f"{unit or 'UNIT'}")
    return False
