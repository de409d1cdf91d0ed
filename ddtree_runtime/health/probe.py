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
import errno
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from ddtree_runtime.health import diagnose, http_client, lossless, sglang_client
from ddtree_runtime.health.http_client import HTTPFailure
from ddtree_runtime.health.report_file import write_json_atomic
from ddtree_runtime.health.sglang_client import BadAnswer, is_int, number, read_json

EXIT_PASS, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_NOT_READY = 0, 1, 2, 3

# Fixed prompts: short, answerable, stable at T=0. Their answers are recorded so a canary can
# compare live and shadow token for token.
DEFAULT_PROMPTS = (
    "The capital of France is",
    "Count from one to ten: one, two, three,",
    "def fibonacci(n):",
)

# Contract causes that an operator knows under a diagnose id (a repeated layer id is a width mismatch
# at run time: SGLang captures the layer once).
_CONTRACT_CAUSE = {"fc_width_mismatch": "hidden_width_mismatch",
                   "layer_ids_repeated": "hidden_width_mismatch"}
# Bounds on the arguments: a probe that may wait longer than a day is a typo, not a setting.
MAX_WAIT_S = 86400.0
MAX_PROMPT_CHARS = 100_000
MAX_AT_ONCE = 64  # prompts sent together in the batch run (SGLang's default max running requests is 48+)


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


class _ProbeInputError(ValueError):
    """Bad arguments: exit 2 with a message saying what to pass instead."""


# ---------------------------------------------------------------------------- static probe


def static_probe(model_path: str, draft_model_path: str) -> Report:
    report = Report("static")
    for label, path in (("--model-path", model_path), ("--draft-model-path", draft_model_path)):
        problem = _model_dir_problem(path)
        if problem:
            report.fail(EXIT_BAD_INPUT, "bad_input", f"{label} {path}: {problem}")
            return report
    from ddtree_runtime.core.contract import ContractError, load_contract

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
        "target_hybrid": contract.hybrid,
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


def _model_dir_problem(path: str) -> str | None:
    """Why a model path given on the command line is not one (bad input), or None."""
    if not path:
        return "empty path; pass the model directory (HF layout)"
    try:
        os.stat(os.path.join(path, "config.json"))
    except FileNotFoundError:
        return "no config.json there; pass the model directory (HF layout)"
    except NotADirectoryError:
        return "not a directory; pass the model directory (HF layout)"
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            return "permission denied; run the probe as a user that can read the model directories"
        return f"cannot read it: {exc.strerror or exc}"
    except ValueError as exc:  # e.g. a NUL byte in the path
        return f"not a usable path ({exc})"
    return None


# ---------------------------------------------------------------------------- readiness


def _progress(msg: str) -> None:
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
            _progress(f"waiting for {base} to be ready: {last_state} ({now - start:.0f} of {timeout:g} s)")
            last_note = now
        time.sleep(min(poll_s, max(0.0, deadline - now)))


# ---------------------------------------------------------------------------- live probe


def _failure_cause(exc: HTTPFailure) -> str:
    """After the server was ready: what a failed exchange says about it."""
    if exc.kind == http_client.TIMEOUT:
        return "request_timeout"
    if exc.kind in (http_client.NOT_HTTP, http_client.TOO_LARGE):
        return "bad_response"
    return "connection_lost"  # refused, closed, unreachable: it answered a moment ago


_FAILURE_HINT = {
    "request_timeout": "the server is hung or overloaded; raise --request-timeout only if it is just slow",
    "bad_response": "is this an SGLang server?",
    "connection_lost": "the server died or restarted during the probe",
}


def _tokenize(base: str, prompts: list[str], timeout: float, report: Report) -> tuple[list | None, str]:
    """The prompts' token ids as the server reads them (the generation and the lossless check then send
    the same ids), or (None, why the lossless check cannot run: a server without /tokenize). A
    /tokenize that is there but fails fails the probe (lossless_check_error)."""
    try:
        ids, why = sglang_client.tokenize(base, prompts, timeout=timeout)
    except HTTPFailure as exc:
        cause = _failure_cause(exc)
        report.check("lossless", False, f"{exc}; {_FAILURE_HINT[cause]}", cause)
        return None, ""
    if ids is None and not sglang_client.tokenize_absent(why):
        report.check("lossless", False, f"{why}: the lossless check cannot run", "lossless_check_error")
    return ids, why


def _count_problem(meta: dict, ids: list[int] | None, tokens: int, max_new_tokens: int) -> str | None:
    """Why an answer's length is not what was asked: max_new_tokens exactly, fewer only when a stop token
    (EOS or a stop id, SGLang's finish_reason {"type": "stop", "matched": ID}) ends it, never more (a
    verify that emits drafts past the end, or stops early, is broken)."""
    n = len(ids) if ids is not None else tokens
    if ids is not None and tokens != len(ids):
        return f"meta_info.completion_tokens {tokens} but {len(ids)} output_ids"
    if n > max_new_tokens:
        return f"{n} tokens for max_new_tokens {max_new_tokens}"
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind == "stop":
        matched = finish.get("matched")
        if is_int(matched) and ids is not None and (not ids or ids[-1] != matched or matched in ids[:-1]):
            return f"finish_reason stop at token {matched}, but the answer does not end at its first one"
        return None
    if n != max_new_tokens:
        return f"{n} tokens for max_new_tokens {max_new_tokens} (finish_reason {str(finish)[:80]})"
    return None


def _post(base: str, payload: dict, timeout: float) -> tuple[int, bytes] | HTTPFailure:
    try:
        return sglang_client.generate(base, payload, timeout=timeout)
    except HTTPFailure as exc:
        return exc


def _generate_doc(answer: tuple[int, bytes] | HTTPFailure, report: Report) -> dict | None:
    """One POST /generate's JSON object, or None once a failure is recorded."""
    if isinstance(answer, HTTPFailure):
        cause = _failure_cause(answer)
        report.check("generate", False, f"{answer}; {_FAILURE_HINT[cause]}", cause)
        return None
    status, body = answer
    doc = read_json(body)
    if status != 200 or not isinstance(doc, dict):
        text = body.decode(errors="replace")[:2000]
        found = diagnose.scan(text)  # the server's error often names the failure itself
        report.check("generate", False, f"HTTP {status}: {text}",
                     found[0].cause if found else "generation_failed")
        return None
    return doc


def _answer(doc: Any, prompt: str, max_new_tokens: int, report: Report, where: str
            ) -> tuple[dict, tuple[int, int | None]] | None:
    """One generation's answer and (completion_tokens, spec_verify_ct), or None once a failure is recorded."""
    if not isinstance(doc, dict):
        report.check("generate", False, f"{where}: {str(doc)[:100]!r} is not an answer object",
                     "bad_response")
        return None
    try:
        parsed = sglang_client.parse_generation(doc)
    except BadAnswer as exc:
        report.check("generate", False, f"{where}: POST /generate answered 200 but {exc}: "
                     "not an SGLang 0.5.23 answer", "bad_response")
        return None
    answer, ids, tokens, verify = parsed.text, parsed.output_ids, parsed.completion_tokens, parsed.verify_ct
    if not answer.strip():
        report.check("generate", False, f"{where}: empty answer to {prompt!r}", "empty_answer")
        return None
    problem = _count_problem(doc.get("meta_info") or {}, ids, tokens, max_new_tokens)
    if problem:
        report.check("generate", False, f"{where} ({prompt[:60]!r}): {problem}: the answer is not what was "
                     "asked (a verify that emits unverified drafts past the end, or stops early)",
                     "wrong_token_count")
        return None
    return {"prompt": prompt, "text": answer, "output_ids": ids}, (tokens, verify)


def _generate(base: str, prompts: list[str], max_new_tokens: int, timeout: float, report: Report,
              prompt_ids: list[list[int]] | None = None) -> list:
    """One greedy generation per prompt (its token ids when known), then all of them again as one batch
    (a verify wrong only in a batch); returns (completion_tokens, spec_verify_ct or None) per answer of
    the one-at-a-time run. ``figures.answers`` / ``figures.batch_answers`` hold both runs' answers."""
    counts, answers, started = [], [], time.monotonic()
    sampling = {"temperature": 0, "max_new_tokens": max_new_tokens}
    payloads = [{**({"text": p} if prompt_ids is None else {"input_ids": prompt_ids[i]}),
                 "sampling_params": sampling} for i, p in enumerate(prompts)]
    for i, (prompt, payload) in enumerate(zip(prompts, payloads, strict=True)):
        doc = _generate_doc(_post(base, payload, timeout), report)
        found = None if doc is None else _answer(doc, prompt, max_new_tokens, report, f"answer {i}")
        if found is None:
            return counts
        answers.append(found[0])
        counts.append(found[1])
    report.figures["generate_seconds"] = round(time.monotonic() - started, 3)
    # All prompts at once: the scheduler decodes them as one batch, as SGLang does a batched request
    # (it hands each of its prompts to the scheduler as a request of its own).
    with ThreadPoolExecutor(max_workers=min(len(payloads), MAX_AT_ONCE)) as pool:
        replies = list(pool.map(lambda payload: _post(base, payload, timeout), payloads))
    batch = []
    for i, (prompt, reply) in enumerate(zip(prompts, replies, strict=True)):
        doc = _generate_doc(reply, report)
        found = None if doc is None else _answer(doc, prompt, max_new_tokens, report, f"batch answer {i}")
        if found is None:
            return counts
        batch.append(found[0])
    tokens = sum(t for t, _ in counts)
    report.figures["completion_tokens"] = tokens
    report.figures["answers"] = answers
    report.figures["batch_answers"] = batch
    report.check("generate", True, f"{len(prompts)} prompt(s) answered at T=0 one at a time and as one "
                 f"batch, {tokens} tokens each time, as many as asked")
    return counts


def _accept_length(counts: list, info: dict, base: str, timeout: float) -> tuple[float | None, str]:
    """Tokens per verify step: per-request meta first, then server state, then /metrics.

    Raises BadAnswer when the server reports it in a shape SGLang never uses."""
    verify = sum(v or 0 for _, v in counts)
    if verify > 0:
        tokens = sum(t for t, _ in counts)
        return tokens / verify, "generate meta_info (completion_tokens / spec_verify_ct)"
    states = info.get("internal_states")
    if states is not None and not isinstance(states, list):
        raise BadAnswer(f"/server_info internal_states is {repr(states)[:60]}, not a list")
    values = [number(s["avg_spec_accept_length"], f"/server_info internal_states[{i}]'s accept length")
              for i, s in enumerate(states or [])
              if isinstance(s, dict) and s.get("avg_spec_accept_length") is not None]
    if values:
        return sum(values) / len(values), "server_info internal_states"
    try:
        status, body = sglang_client.metrics(base, timeout=timeout)
    except HTTPFailure:
        return None, "not reported"
    if status == 200:
        value = sglang_client.metric_value(body.decode(errors="replace"), "sglang:spec_accept_length")
        if value is not None:
            return value, "/metrics sglang:spec_accept_length"
    return None, "not reported"


def _block_size(report: Report, info: dict) -> int | None:
    """The most tokens one verify step can accept (bonus included): the drafter's block size."""
    for value in (report.handshake.get("block_size"), info.get("speculative_dflash_block_size"),
                  info.get("speculative_num_draft_tokens")):
        if isinstance(value, int) and not isinstance(value, bool) and 2 <= value <= 10**6:
            return value
    return None


def _check_accept_length(report: Report, info: dict, counts: list, base: str, timeout: float,
                         min_accept_length: float | None) -> None:
    try:
        accept, source = _accept_length(counts, info, base, timeout)
    except BadAnswer as exc:
        report.check("accept_length", False, f"{exc}: not an SGLang 0.5.23 answer", "bad_response")
        return
    report.figures["accept_length_source"] = source
    if accept is None:
        report.figures["accept_length"] = None
        if min_accept_length is not None:
            report.check("accept_length", False, f"not reported by the server, minimum {min_accept_length:g}",
                         "acceptance_low")
        return
    block = _block_size(report, info)
    # Per-request meta counts the prefill's first token too: up to one token more than a block per request.
    upper = None if block is None else block + (1 if source.startswith("generate") else 0)
    valid = math.isfinite(accept) and accept >= 1 and (upper is None or accept <= upper)
    report.figures["accept_length"] = round(accept, 4) if valid else None
    if not valid:
        bound = f"1..{upper}" if upper is not None else "at least 1"
        report.figures["accept_length_reported"] = repr(accept)
        report.check("accept_length", False, f"the server reports {accept!r} tokens per verify step "
                     f"({source}), outside the possible range {bound} (block size {block}): its "
                     "speculative counters are broken", "accept_length_invalid")
        return
    if min_accept_length is not None:
        report.check("accept_length", accept >= min_accept_length,
                     f"{accept:.3f} tokens per verify step, minimum {min_accept_length:g} ({source})",
                     "acceptance_low")


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
    detail = f"status {status!r}, expected width {exp!r}, observed {obs!r}, drafter fc in_features {fc!r}"

    def width(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v > 0

    if status == "mismatch" or (obs is not None and obs != exp) or (fc is not None and fc != exp):
        report.check("handshake", False, detail, "hidden_width_mismatch")
    elif status == "missing":
        report.check("handshake", False, detail, "hidden_states_missing")
    elif status != "ok" or obs is None:
        report.check("handshake", False, detail + " (still pending after a generation)", "handshake_pending")
    elif not (width(exp) and width(obs) and (fc is None or width(fc))):
        report.check("handshake", False, detail + ": widths must be positive integers", "bad_response")
    else:
        report.check("handshake", True, detail)


def _run_lossless(base: str, report: Report, prompt_ids: list | None, skipped: str, margin: float,
                  timeout: float, max_near_tie_rate: float = lossless.DEFAULT_MAX_NEAR_TIE_RATE
                  ) -> dict[str, Any] | None:
    """The lossless check's HTTP part, right after the generation, on both runs' answers (one at a time,
    then the batch); None once a failure is recorded."""
    answers = (report.figures.get("answers") or []) + (report.figures.get("batch_answers") or [])
    if prompt_ids is None:
        return lossless.not_checked(skipped, margin)
    missing = sum(a["output_ids"] is None for a in answers)
    if missing == len(answers):
        return lossless.not_checked("the /generate answers carry no output_ids", margin)
    if missing:  # a server that gives output_ids on some answers claims them
        return lossless.check_failed(f"{missing} of {len(answers)} /generate answers carry no output_ids",
                                     margin)
    generations = [lossless.Generation(ids, a["output_ids"])
                   for ids, a in zip(prompt_ids * 2, answers, strict=True)]
    try:
        return lossless.verify(base, generations, margin=margin, timeout=timeout,
                               max_near_tie_rate=max_near_tie_rate)
    except HTTPFailure as exc:
        cause = _failure_cause(exc)
        report.check("lossless", False, f"{exc}; {_FAILURE_HINT[cause]}", cause)
    except BadAnswer as exc:
        report.check("lossless", False, f"{exc}: not an SGLang 0.5.23 answer", "bad_response")
    return None


def _check_lossless(report: Report, doc: dict[str, Any], allow_unchecked: bool = False) -> None:
    """Fails closed: a failed check names its cause; not_checked passes only where the operator allowed
    it (--allow-lossless-unchecked), and is said in the check line either way."""
    report.figures["lossless"] = doc
    if doc["status"] == lossless.NOT_CHECKED:
        detail = lossless.summary(doc)
        if not allow_unchecked:
            detail += ("; the probe cannot prove this server lossless (pass --allow-lossless-unchecked, "
                       "role variable ddtree_probe_allow_lossless_unchecked, to accept that)")
        report.check("lossless", allow_unchecked, detail, "lossless_not_checked")
        return
    ok = doc["status"] == lossless.PASSED
    report.check("lossless", ok, lossless.summary(doc), lossless.failure_cause(doc))


def check_live_args(url: str, *, timeout: float, request_timeout: float, max_new_tokens: int,
                    min_accept_length: float | None, prompts: list[str] | None, poll_s: float = 2.0,
                    lossless_margin: float = lossless.DEFAULT_MARGIN,
                    max_near_tie_rate: float = lossless.DEFAULT_MAX_NEAR_TIE_RATE) -> str:
    """The base URL; _ProbeInputError (exit 2) naming the first argument that cannot work."""
    try:
        base = http_client.check_base_url(url)
    except ValueError as exc:
        raise _ProbeInputError(f"--url {exc}") from None
    for flag, value in (("--timeout", timeout), ("--request-timeout", request_timeout), ("poll_s", poll_s)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
                math.isfinite(value) and 0 < value <= MAX_WAIT_S):
            raise _ProbeInputError(f"{flag} {value!r}: pass a number of seconds in (0, {MAX_WAIT_S:g}]")
    if not is_int(max_new_tokens) or not 1 <= max_new_tokens <= 100_000:
        raise _ProbeInputError(f"--max-new-tokens {max_new_tokens!r}: pass an integer in 1..100000")
    if min_accept_length is not None and not (
            isinstance(min_accept_length, int | float) and math.isfinite(min_accept_length)
            and 1 <= min_accept_length <= 10**4):
        raise _ProbeInputError(f"--min-accept-length {min_accept_length!r}: pass a finite number >= 1 "
                               "(tokens per verify step; 1.0 means no draft token is ever accepted)")
    if isinstance(lossless_margin, bool) or not isinstance(lossless_margin, int | float) or not (
            math.isfinite(lossless_margin) and 0 <= lossless_margin <= 100):
        raise _ProbeInputError(f"--lossless-margin {lossless_margin!r}: pass a number of nats in [0, 100] "
                               f"(default {lossless.DEFAULT_MARGIN:g})")
    if isinstance(max_near_tie_rate, bool) or not isinstance(max_near_tie_rate, int | float) or not (
            math.isfinite(max_near_tie_rate) and 0 <= max_near_tie_rate <= 1):
        raise _ProbeInputError(f"--max-near-tie-rate {max_near_tie_rate!r}: pass a fraction of the checked "
                               f"tokens in [0, 1] (default {lossless.DEFAULT_MAX_NEAR_TIE_RATE:g})")
    if prompts is not None:
        if not prompts:
            raise _ProbeInputError("--prompts: pass at least one prompt")
        for prompt in prompts:
            if not isinstance(prompt, str) or not prompt.strip() or len(prompt) > MAX_PROMPT_CHARS:
                raise _ProbeInputError(f"--prompts {str(prompt)[:40]!r}: each prompt must be non-blank text "
                                       f"of at most {MAX_PROMPT_CHARS} characters")
    return base


def live_probe(url: str, *, timeout: float = 600, min_accept_length: float | None = None,
               prompts: list[str] | None = None, max_new_tokens: int = 32, request_timeout: float = 120,
               expect: dict[str, str] | None = None, poll_s: float = 2.0, unit: str | None = None,
               lossless_margin: float = lossless.DEFAULT_MARGIN, allow_lossless_unchecked: bool = False,
               max_near_tie_rate: float = lossless.DEFAULT_MAX_NEAR_TIE_RATE) -> Report:
    report = Report("live")
    base = check_live_args(url, timeout=timeout, request_timeout=request_timeout,
                           max_new_tokens=max_new_tokens, min_accept_length=min_accept_length,
                           prompts=prompts, poll_s=poll_s, lossless_margin=lossless_margin,
                           max_near_tie_rate=max_near_tie_rate)
    report.figures["url"] = base
    if not wait_ready(base, timeout, report, poll_s=poll_s, unit=unit):
        return report
    prompts = list(prompts or DEFAULT_PROMPTS)
    prompt_ids, skipped = _tokenize(base, prompts, request_timeout, report)
    if not report.ok:
        return report
    counts = _generate(base, prompts, max_new_tokens, request_timeout, report, prompt_ids)
    if not report.ok:
        return report
    checked = _run_lossless(base, report, prompt_ids, skipped, lossless_margin, request_timeout,
                            max_near_tie_rate)
    if checked is None:
        return report
    try:
        status, info = sglang_client.server_info(base, timeout=request_timeout)
    except HTTPFailure as exc:
        cause = _failure_cause(exc)
        report.check("server_info", False, f"{exc}; {_FAILURE_HINT[cause]}", cause)
        return report
    if status != 200 or not isinstance(info, dict):
        shown = f"HTTP {status}" if status != 200 else "HTTP 200 but not a JSON object"
        report.check("server_info", False, f"/server_info {shown}", "server_info_unavailable")
        return report
    report.figures["version"] = str(info.get("version"))[:100]
    algorithm = str(info.get("speculative_algorithm") or "NONE").upper()[:100]
    report.figures["speculative_algorithm"] = algorithm
    report.figures["overlap_schedule"] = overlap_schedule(info)
    wanted = {"speculative_algorithm": "DDTREE", **(expect or {})}
    wrong = [f"{k}={repr(info.get(k))[:100]} (want {v})" for k, v in wanted.items()
             if str(info.get(k)).upper() != str(v).upper()]
    report.check("flags", not wrong, "; ".join(wrong) or
                 ", ".join(f"{k}={info.get(k)}" for k in wanted), "flags_mismatch")
    if algorithm == "DDTREE":
        _check_handshake(report, info.get("ddtree_handshake"))
    _check_lossless(report, checked, allow_lossless_unchecked)
    _check_accept_length(report, info, counts, base, request_timeout, min_accept_length)
    if report.ok:
        hybrid = ", hybrid target" if report.handshake.get("target_hybrid") is True else ""
        shown = (f"lossless on {checked['tokens_checked']} tokens" if checked["status"] == lossless.PASSED
                 else "lossless not checked")
        report.message = (f"{base} ready, {algorithm}{hybrid}, handshake "
                          f"{report.handshake.get('status', 'n/a')}, {shown}, accept length "
                          f"{report.figures['accept_length']}")
    return report


def overlap_schedule(info: dict[str, Any]) -> bool | None:
    """Whether the server runs SGLang's overlap scheduler: the plugin's ``ddtree_overlap_schedule``,
    else SGLang's own resolved ``disable_overlap_schedule``; None when neither is a boolean."""
    value = info.get("ddtree_overlap_schedule")
    if isinstance(value, bool):
        return value
    disabled = info.get("disable_overlap_schedule")
    return (not disabled) if isinstance(disabled, bool) else None


# ---------------------------------------------------------------------------- output


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
               if k not in ("answers", "diagnosis", "lossless") and v is not None}
    if figures:
        lines.append("  figures: " + ", ".join(f"{k}={v}" for k, v in figures.items()))
    return "\n".join(lines)


def _mark(check: Check) -> str:
    if not check.ok:
        return "FAIL"
    return "skip" if check.detail.startswith("not checked") else "ok  "


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
    except _ProbeInputError as exc:
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
            raise _ProbeInputError(f"--expect {item!r}: write KEY=VALUE, e.g. --expect context_length=32768")
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
            raise _ProbeInputError(f"--unit {args.unit[:60]!r} is not a systemd unit name")
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
