"""`ddtree probe static|live`: the gates a rollout runs before and after a restart.

static: the model pair on disk agrees on the hidden-state contract (configs and safetensors header).
live:   the server is ready, runs DDTREE with the expected handshake, answers fixed prompts at T=0,
        and accepts enough draft tokens per verify step.

Exit codes (an Ansible task gates on them): 0 pass, 1 a check failed, 2 bad input, 3 server not
reachable or not ready in time. Host side: stdlib only (plus our contract and diagnose).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ddtree_runtime import diagnose

EXIT_PASS, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_NOT_READY = 0, 1, 2, 3

# Fixed prompts: short, answerable, stable at T=0. Their answers are recorded so a canary can
# compare live and shadow token for token.
DEFAULT_PROMPTS = (
    "The capital of France is",
    "Count from one to ten: one, two, three,",
    "def fibonacci(n):",
)

# Contract causes that an operator knows under a diagnose id.
_CONTRACT_CAUSE = {"fc_width_mismatch": "hidden_width_mismatch"}


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
        return asdict(self)


class _ProbeInputError(ValueError):
    """Bad arguments: exit 2 with a message saying what to pass instead."""


# ---------------------------------------------------------------------------- static probe


def static_probe(model_path: str, draft_model_path: str) -> Report:
    report = Report("static")
    for label, path in (("--model-path", model_path), ("--draft-model-path", draft_model_path)):
        if not Path(path, "config.json").is_file():
            report.fail(EXIT_BAD_INPUT, "bad_input",
                        f"{label} {path}: no config.json there; pass the model directory (HF layout)")
            return report
    from ddtree_runtime.contract import ContractError, load_contract

    try:
        contract = load_contract(model_path, draft_model_path, check=False)  # we report the widths
    except ContractError as exc:
        cause = getattr(exc, "cause", "bad_config")
        report.check("contract", False, f"{exc} [{cause}]", _CONTRACT_CAUSE.get(cause, cause))
        return report
    c = contract.to_dict()
    report.figures.update(c)
    report.handshake = {
        "algorithm": "DDTREE", "block_size": contract.block_size,
        "target_hidden_size": contract.target_hidden_size,
        "target_layer_ids": list(contract.target_layer_ids),
        "expected_hidden_width": contract.capture_width,
        "draft_fc_in_features": contract.fc_in_features,
    }
    report.check("contract", True, f"configs and drafter fc.weight header read; "
                 f"warnings: {'; '.join(contract.warnings) or 'none'}")
    report.check("capture_width", contract.capture_width == contract.fc_in_features,
                 f"target captures [N, {contract.capture_width}] ({len(contract.target_layer_ids)} layers x "
                 f"{contract.target_hidden_size}), drafter fc expects [N, {contract.fc_in_features}]",
                 "hidden_width_mismatch")
    report.check("block_size", contract.block_size >= 2,
                 f"block_size {contract.block_size} (the tree needs a horizon of at least 1)", "bad_config")
    if report.ok:
        report.message = (f"model pair agrees: capture width {contract.capture_width}, "
                          f"block size {contract.block_size}{', hybrid target' if contract.hybrid else ''}")
    return report


# ---------------------------------------------------------------------------- HTTP


def http_request(url: str, *, payload: dict | None = None, timeout: float) -> tuple[int, bytes]:
    """(status, body); HTTP errors are returned, connection errors raised (URLError/OSError)."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


def _progress(msg: str) -> None:
    print(f"probe: {msg}", file=sys.stderr, flush=True)


def unit_gave_up(unit: str) -> bool:
    """True once systemd stopped restarting the unit (ActiveState=failed: start limit hit)."""
    name = unit if unit.endswith(".service") else f"{unit}.service"
    try:
        out = subprocess.run(["systemctl", "show", name, "-p", "ActiveState"], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return out.strip() == "ActiveState=failed"


def wait_ready(base: str, timeout: float, report: Report, *, poll_s: float = 2.0,
               unit: str | None = None) -> bool:
    """Poll /health_generate until 200 (SGLang answers 503 until warm-up is done).

    With `unit`, stop early once systemd has given up on it: waiting longer cannot help.
    """
    start = time.monotonic()
    deadline, last_note, last_state = start + timeout, start, "no answer yet"
    reached = refused_after_reached = False
    while True:
        remaining = deadline - time.monotonic()
        try:
            status, _ = http_request(f"{base}/health_generate", timeout=max(1.0, min(30.0, remaining)))
            reached, refused_after_reached = True, False
            if status == 200:
                report.figures["ready_seconds"] = round(time.monotonic() - start, 3)
                report.check("ready", True, f"/health_generate 200 after {report.figures['ready_seconds']} s")
                return True
            last_state = f"HTTP {status}"
        except (urllib.error.URLError, OSError) as exc:
            last_state = f"{getattr(exc, 'reason', exc)}"
            refused_after_reached = reached
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
            _progress(f"waiting for {base} to be ready: {last_state} ({now - start:.0f} of {timeout:g} s)")
            last_note = now
        time.sleep(min(poll_s, max(0.0, deadline - now)))


# ---------------------------------------------------------------------------- live probe


def _generate(base: str, prompts: list[str], max_new_tokens: int, timeout: float, report: Report) -> list:
    metas, answers, started = [], [], time.monotonic()
    for prompt in prompts:
        payload = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
        try:
            status, body = http_request(f"{base}/generate", payload=payload, timeout=timeout)
        except (urllib.error.URLError, OSError) as exc:
            report.check("generate", False, f"POST /generate failed: {getattr(exc, 'reason', exc)}",
                         "generation_failed")
            return metas
        doc = _json(body)
        if status != 200 or not isinstance(doc, dict):
            text = body.decode(errors="replace")[:2000]
            found = diagnose.scan(text)  # the server's error often names the failure itself
            report.check("generate", False, f"HTTP {status}: {text}",
                         found[0].cause if found else "generation_failed")
            return metas
        answer = str(doc.get("text", ""))
        answers.append({"prompt": prompt, "text": answer, "output_ids": doc.get("output_ids")})
        metas.append(doc.get("meta_info") or {})
        if not answer.strip():
            report.check("generate", False, f"empty answer to {prompt!r}", "empty_answer")
            return metas
    report.figures["generate_seconds"] = round(time.monotonic() - started, 3)
    tokens = sum(int(m.get("completion_tokens", 0) or 0) for m in metas)
    report.figures["completion_tokens"] = tokens
    report.figures["answers"] = answers
    report.check("generate", True, f"{len(prompts)} prompt(s) answered at T=0, {tokens} tokens")
    return metas


def _accept_length(metas: list[dict], info: dict, base: str, timeout: float) -> tuple[float | None, str]:
    """Tokens per verify step: per-request meta first, then server state, then /metrics."""
    verify = sum(int(m.get("spec_verify_ct", 0) or 0) for m in metas)
    if verify > 0:
        tokens = sum(int(m.get("completion_tokens", 0) or 0) for m in metas)
        return tokens / verify, "generate meta_info (completion_tokens / spec_verify_ct)"
    states = [s.get("avg_spec_accept_length") for s in info.get("internal_states") or []
              if isinstance(s, dict) and s.get("avg_spec_accept_length") is not None]
    if states:
        return sum(map(float, states)) / len(states), "server_info internal_states"
    try:
        status, body = http_request(f"{base}/metrics", timeout=timeout)
    except (urllib.error.URLError, OSError):
        return None, "not reported"
    if status == 200:
        for line in body.decode(errors="replace").splitlines():
            if line.startswith("sglang:spec_accept_length"):
                return float(line.rsplit(" ", 1)[1]), "/metrics sglang:spec_accept_length"
    return None, "not reported"


def _check_handshake(report: Report, hs: Any) -> None:
    if not isinstance(hs, dict):
        report.check("handshake", False, "server_info has no ddtree_handshake: the DDTREE plugin did not "
                     "load in this server", "plugin_not_registered")
        return
    report.handshake = hs
    exp, obs = hs.get("expected_hidden_width"), hs.get("observed_hidden_width")
    fc = hs.get("draft_fc_in_features")
    report.figures.update(expected_hidden_width=exp, observed_hidden_width=obs, draft_fc_in_features=fc,
                          budget=hs.get("budget"))
    status = hs.get("status")
    detail = f"status {status}, expected width {exp}, observed {obs}, drafter fc in_features {fc}"
    if status == "mismatch" or (obs is not None and obs != exp) or (fc is not None and fc != exp):
        report.check("handshake", False, detail, "hidden_width_mismatch")
    elif status == "missing":
        report.check("handshake", False, detail, "hidden_states_missing")
    elif status != "ok" or obs is None:
        report.check("handshake", False, detail + " (still pending after a generation)", "handshake_pending")
    else:
        report.check("handshake", True, detail)


def live_probe(url: str, *, timeout: float = 600, min_accept_length: float | None = None,
               prompts: list[str] | None = None, max_new_tokens: int = 32, request_timeout: float = 120,
               expect: dict[str, str] | None = None, poll_s: float = 2.0, unit: str | None = None) -> Report:
    report = Report("live")
    base = url.rstrip("/")
    parts = urllib.parse.urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise _ProbeInputError(f"--url {url!r} is not an http(s) URL; pass e.g. http://127.0.0.1:30000")
    report.figures["url"] = base
    if not wait_ready(base, timeout, report, poll_s=poll_s, unit=unit):
        return report
    metas = _generate(base, list(prompts or DEFAULT_PROMPTS), max_new_tokens, request_timeout, report)
    if not report.ok:
        return report
    status, body = http_request(f"{base}/server_info", timeout=request_timeout)
    info = _json(body)
    if status != 200 or not isinstance(info, dict):
        report.check("server_info", False, f"/server_info HTTP {status}", "server_info_unavailable")
        return report
    report.figures["version"] = info.get("version")
    algorithm = str(info.get("speculative_algorithm") or "NONE").upper()
    report.figures["speculative_algorithm"] = algorithm
    wanted = {"speculative_algorithm": "DDTREE", **(expect or {})}
    wrong = [f"{k}={info.get(k)!r} (want {v})" for k, v in wanted.items()
             if str(info.get(k)).upper() != str(v).upper()]
    report.check("flags", not wrong, "; ".join(wrong) or
                 ", ".join(f"{k}={info.get(k)}" for k in wanted), "flags_mismatch")
    if algorithm == "DDTREE":
        _check_handshake(report, info.get("ddtree_handshake"))
    accept, source = _accept_length(metas, info, base, request_timeout)
    report.figures["accept_length"] = None if accept is None else round(accept, 4)
    report.figures["accept_length_source"] = source
    if min_accept_length is not None:
        shown = "not reported by the server" if accept is None else f"{accept:.3f}"
        report.check("accept_length", accept is not None and accept >= min_accept_length,
                     f"{shown} tokens per verify step, minimum {min_accept_length:g} ({source})",
                     "acceptance_low")
    if report.ok:
        report.message = (f"{base} ready, {algorithm}, handshake "
                          f"{report.handshake.get('status', 'n/a')}, accept length "
                          f"{report.figures['accept_length']}")
    return report


# ---------------------------------------------------------------------------- output


_VAGUE_CAUSES = (None, "not_ready", "unreachable", "generation_failed")


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


def write_report(report: Report, path: str) -> None:
    """Atomic write (temp file + rename), so a reader never sees half a report."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    with os.fdopen(fd, "w") as fh:
        json.dump(report.to_dict(), fh, indent=2)
    os.chmod(tmp, 0o644)
    os.replace(tmp, target)


def format_report(report: Report) -> str:
    head = f"{report.probe} probe: {'PASS' if report.ok else 'FAIL'}"
    if not report.ok:
        head += f" [{report.cause}] (exit {report.exit_code})"
    lines = [head, f"  {report.message}"] if report.message else [head]
    lines += [f"  {'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}" for c in report.checks]
    figures = {k: v for k, v in report.figures.items() if k not in ("answers", "diagnosis") and v is not None}
    if figures:
        lines.append("  figures: " + ", ".join(f"{k}={v}" for k, v in figures.items()))
    return "\n".join(lines)


def _emit(report: Report, args: argparse.Namespace) -> int:
    if getattr(args, "write_report", None):
        try:
            write_report(report, args.write_report)
        except OSError as exc:
            print(f"probe: cannot write {args.write_report}: {exc}", file=sys.stderr)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return report.exit_code


def _parse_expect(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise _ProbeInputError(f"--expect {item!r}: write KEY=VALUE, e.g. --expect context_length=32768")
        out[key] = value
    return out


def _timed(report_fn: Callable[..., Report], *args: Any, **kwargs: Any) -> Report:
    started = time.monotonic()
    report = report_fn(*args, **kwargs)
    report.figures["probe_seconds"] = round(time.monotonic() - started, 3)
    return report


def _run_static(args: argparse.Namespace) -> int:
    return _emit(_timed(static_probe, args.model_path, args.draft_model_path), args)


def _run_live(args: argparse.Namespace) -> int:
    try:
        report = _timed(live_probe, args.url, timeout=args.timeout, min_accept_length=args.min_accept_length,
                            prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                            request_timeout=args.request_timeout, expect=_parse_expect(args.expect),
                            unit=args.unit)
    except _ProbeInputError as exc:
        report = Report("live")
        report.fail(EXIT_BAD_INPUT, "bad_input", str(exc))
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
    live.set_defaults(func=_run_live)
