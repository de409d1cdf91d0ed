"""The probe's report: its checks, the first failure's cause and exit code, strict JSON, one line a check.

The static and the live probe fill one :class:`Report`; the first failed check names the cause and the
exit code an Ansible task gates on (0 pass, 1 a check failed, 2 bad input, 3 server not reachable or not
ready in time). The canary lists its checks as :class:`Check` too. Host side: stdlib only.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ddtree_runtime.health import http_client
from ddtree_runtime.health.http_client import HTTPFailure
from ddtree_runtime.health.report_file import write_json_atomic

EXIT_PASS, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_NOT_READY = 0, 1, 2, 3


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Report:
    probe: str
    ok: bool = True
    cause: str | None = None
    message: str = ""
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    handshake: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)
    exit_code: int = EXIT_PASS

    def check(self, name: str, ok: bool, detail: str, cause: str | None = None) -> bool:
        self.checks.append(Check(name, ok, detail))
        if not ok and self.ok:  # the first failure names the cause
            self.fail(EXIT_FAILED, cause or name, f"{name}: {detail}")
        return ok

    def fail(self, exit_code: int, cause: str, message: str) -> None:
        self.ok, self.exit_code, self.cause, self.message = False, exit_code, cause, message

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready and strict JSON: what a server sent (NaN, Infinity, deep nesting) is tamed."""
        return _json_safe(asdict(self))


def _json_safe(value: Any, depth: int = 0) -> Any:
    if depth > 32:
        return "<nested too deeply>"
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k)[:200]: _json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v, depth + 1) for v in value]
    if isinstance(value, str):
        return value if len(value) <= 20_000 else value[:20_000] + "..."
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**63:
        return str(value)[:40] + "..."
    return value


class ProbeInputError(ValueError):
    """Bad arguments: exit 2 with a message saying what to pass instead."""


# ---------------------------------------------------------------------------- a failed exchange


def failure_cause(exc: HTTPFailure) -> str:
    """After the server was ready: what a failed exchange says about it."""
    if exc.kind == http_client.TIMEOUT:
        return "request_timeout"
    if exc.kind in (http_client.NOT_HTTP, http_client.TOO_LARGE):
        return "bad_response"
    return "connection_lost"  # refused, closed, unreachable: it answered a moment ago


FAILURE_HINT = {
    "request_timeout": "the server is hung or overloaded; raise --request-timeout only if it is just slow",
    "bad_response": "is this an SGLang server?",
    "connection_lost": "the server died or restarted during the probe",
}


def check_exchange(report: Report, name: str, exc: HTTPFailure) -> None:
    """Record an exchange that failed after the server was ready as the failed check ``name``."""
    cause = failure_cause(exc)
    report.check(name, False, f"{exc}; {FAILURE_HINT[cause]}", cause)


# ---------------------------------------------------------------------------- output


def write_report(report: Report, path: str) -> None:
    """The report as strict JSON, written atomically (health.report_file)."""
    write_json_atomic(report.to_dict(), path)


def format_report(report: Report) -> str:
    head = f"{report.probe} probe: {'PASS' if report.ok else 'FAIL'}"
    if not report.ok:
        head += f" [{report.cause}] (exit {report.exit_code})"
    lines = [head, f"  {report.message}"] if report.message else [head]
    lines += [f"  {_mark(c)} {c.name}: {c.detail}" for c in report.checks]
    figures = {k: v for k, v in report.figures.items()
               if k not in ("answers", "diagnosis", "lossless", "decoder") and v is not None}
    if figures:
        lines.append("  figures: " + ", ".join(f"{k}={v}" for k, v in figures.items()))
    return "\n".join(lines)


def _mark(check: Check) -> str:
    if not check.ok:
        return "FAIL"
    return "skip" if check.detail.startswith("not checked") else "ok  "
