"""`ddtree probe static|live`: the gates a rollout runs before and after a restart.

static: the model pair on disk agrees on the hidden-state contract (configs and safetensors header).
live:   the server is ready, runs DDTREE with the expected handshake, answers fixed prompts at T=0
        (one at a time, then all of them as one batch) with as many tokens as asked (fewer only where a
        stop token ended the answer), every token it emitted is the target's own greedy choice (one
        prefill of prompt + answer per answer, ddtree_runtime.health.lossless), and it accepts enough draft
        tokens per verify step. The probe fails closed: a lossless check that cannot run on a server
        that has the fields fails (``lossless_check_error``); one without them fails too
        (``lossless_not_checked``) unless --allow-lossless-unchecked says the operator accepts that.

Exit codes (an Ansible task gates on them): 0 pass, 1 a check failed, 2 bad input, 3 server not
reachable or not ready in time. Every HTTP exchange ends within its deadline (--timeout for readiness,
--request-timeout for each request after it), however slowly the server answers, so `probe live`
ends within --timeout + (3 x prompts + 4) x --request-timeout. Host side: stdlib only (plus our contract,
diagnose, lossless, http_client and sglang_client).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from ddtree_runtime.health import diagnose, lossless
from ddtree_runtime.health.probe_live import live_probe
from ddtree_runtime.health.probe_report import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    ProbeInputError,
    Report,
    format_report,
    write_report,
)
from ddtree_runtime.health.probe_static import static_probe

# Causes the unit's journal may name better (the server crashed, ran out of memory, ...).
_VAGUE_CAUSES = (None, "not_ready", "unreachable", "generation_failed", "connection_lost", "request_timeout")
_UNIT_NAME = re.compile(r"^[A-Za-z0-9:_.@\\-]{1,200}$")


def attach_diagnosis(report: Report, unit: str, *, settle_s: float = 3.0) -> None:
    """On a failed live probe, name the cause from the unit's journal (when we are on the host)."""
    try:
        findings = diagnose.scan(diagnose.read_unit_journal(unit))
        if not findings and report.cause in _VAGUE_CAUSES and settle_s > 0:
            # A server that died under our request logs its traceback a moment later.
            time.sleep(settle_s)
            findings = diagnose.scan(diagnose.read_unit_journal(unit))
    except Exception as exc:  # no journal here is not a probe failure
        report.figures["diagnosis"] = f"journal of {unit} unreadable: {exc}"
        return
    report.figures["diagnosis"] = [f.to_dict() for f in findings]
    if findings and report.cause in _VAGUE_CAUSES:
        report.cause = findings[0].cause
        report.message += f"; journal of {unit}: {findings[0].summary}. Fix: {findings[0].fix}"


def _emit(report: Report, args: argparse.Namespace) -> int:
    if getattr(args, "write_report", None):
        try:
            write_report(report, args.write_report)
        except (OSError, ValueError) as exc:
            print(f"probe: cannot write {args.write_report}: {exc}", file=sys.stderr)
    print(json.dumps(report.to_dict(), indent=2, allow_nan=False) if args.json else format_report(report))
    return report.exit_code


def _guarded(probe: str, run: Callable[[], Report]) -> Report:
    """The last line of defence: a probe that cannot decide says so in one line and fails; it never
    passes and never prints a traceback (DDTREE_DEBUG=1 re-raises, for a bug report)."""
    try:
        return run()
    except ProbeInputError as exc:
        report = Report(probe)
        report.fail(EXIT_BAD_INPUT, "bad_input", str(exc))
        return report
    except Exception as exc:
        if os.environ.get("DDTREE_DEBUG"):
            raise
        report = Report(probe)
        report.fail(EXIT_FAILED, "probe_error", f"the probe could not decide ({type(exc).__name__}: "
                    f"{str(exc)[:200]}); treat it as failed; DDTREE_DEBUG=1 shows the traceback")
        return report


def _parse_expect(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ProbeInputError(f"--expect {item!r}: write KEY=VALUE, e.g. --expect context_length=32768")
        out[key] = value
    return out


def _timed(report_fn: Callable[..., Report], *args: Any, **kwargs: Any) -> Report:
    started = time.monotonic()
    report = report_fn(*args, **kwargs)
    report.figures["probe_seconds"] = round(time.monotonic() - started, 3)
    return report


def _run_static(args: argparse.Namespace) -> int:
    report = _guarded("static", lambda: _timed(static_probe, args.model_path, args.draft_model_path))
    return _emit(report, args)


def _run_live(args: argparse.Namespace) -> int:
    def run() -> Report:
        if args.unit is not None and not _UNIT_NAME.match(args.unit):
            raise ProbeInputError(f"--unit {args.unit[:60]!r} is not a systemd unit name")
        return _timed(live_probe, args.url, timeout=args.timeout, min_accept_length=args.min_accept_length,
                      prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                      request_timeout=args.request_timeout, expect=_parse_expect(args.expect), unit=args.unit,
                      lossless_margin=args.lossless_margin,
                      allow_lossless_unchecked=args.allow_lossless_unchecked,
                      max_near_tie_rate=args.max_near_tie_rate)

    report = _guarded("live", run)
    if not report.ok and args.unit and report.exit_code != EXIT_BAD_INPUT:
        attach_diagnosis(report, args.unit)
    return _emit(report, args)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("probe", help="static (model files) and live (HTTP) probes that gate a rollout",
                              description=__doc__)
    sub = p.add_subparsers(dest="probe_kind", metavar="KIND")
    p.set_defaults(func=lambda _a: (p.print_help(), EXIT_BAD_INPUT)[1])

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON report")
    common.add_argument("--write-report", metavar="PATH",
                        help="also store the JSON report there (e.g. /var/lib/ddtree/probe/UNIT.json)")

    s = sub.add_parser("static", parents=[common], help="target/draft pair on disk: hidden-state contract")
    s.add_argument("--model-path", required=True, help="target model directory")
    s.add_argument("--draft-model-path", required=True, help="DFlash drafter directory")
    s.set_defaults(func=_run_static)

    live = sub.add_parser("live", parents=[common], help="a running server: ready, handshake, generation")
    live.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:30000")
    live.add_argument("--timeout", type=float, default=600, help="seconds to wait for readiness")
    live.add_argument("--min-accept-length", type=float, default=None,
                      help="fail below this acceptance length (tokens per verify step)")
    live.add_argument("--prompts", nargs="+", default=None, help="prompts (default: built-in set)")
    live.add_argument("--max-new-tokens", type=int, default=32)
    live.add_argument("--request-timeout", type=float, default=120, help="seconds per HTTP request")
    live.add_argument("--expect", action="append", default=[], metavar="KEY=VALUE",
                      help="a /server_info field that must have this value (repeatable)")
    live.add_argument("--unit", help="stop waiting once systemd gives up on this unit; on failure, "
                      "name the cause from its journal")
    live.add_argument("--lossless-margin", type=float, default=lossless.DEFAULT_MARGIN, metavar="NATS",
                      help="an emitted token this close to the target's top-1 is a near-tie, not a mismatch "
                      f"(default {lossless.DEFAULT_MARGIN:g}: bf16 verify and prefill kernels differ)")
    live.add_argument("--max-near-tie-rate", type=float, default=lossless.DEFAULT_MAX_NEAR_TIE_RATE,
                      metavar="FRACTION", help="fail when more of the checked tokens than this are near-ties "
                      f"(default {lossless.DEFAULT_MAX_NEAR_TIE_RATE:g}: a verify that flips near-ties)")
    live.add_argument("--allow-lossless-unchecked", action="store_true",
                      help="pass a server that has no /tokenize or logprob fields at all, so the lossless "
                      "check cannot run (default: fail, cause lossless_not_checked)")
    live.set_defaults(func=_run_live)
