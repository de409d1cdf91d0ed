"""Is a speculative server lossless? The target's own prefill is the oracle.

At T = 0 every token a speculative server emits must be the target's greedy choice after the tokens
before it. A prefill of the prompt plus the emitted tokens runs no speculative path (no draft, no tree,
no verify mask, no KV commit): its per-position top-1 is what the target chooses there. So the check
sends, for every answer, ``prompt ids + emitted ids`` back as ``input_ids`` with SGLang 0.5.23's logprob
fields (``return_logprob``, ``logprob_start_len`` = prompt length - 1, ``top_logprobs_num`` 2,
``max_new_tokens`` 1: a prefill, never a decode) and compares position by position
``meta_info.input_top_logprobs`` (the target's top two) with the token the server emitted there
(``meta_info.input_token_logprobs`` echoes it with its logprob). Each answer is checked by a request of
its own, so one answer the check cannot read never hides another's mismatch. A token the target gives
probability 0 (its logprob -inf, which SGLang's JSON writes as null) is a mismatch.

Near-ties are not failures. A position whose emitted token is not the target's top-1 but within
``margin`` nats of it (``DEFAULT_MARGIN``) is a near-tie: a verify and a prefill run different kernels
(tree-masked verify attention over B+1 rows vs. the extend path over the whole sequence, other tile
sizes and reduction orders), and in bf16 a logit is only stored to 8 significant bits (the spacing is
0.125 for logits in [16, 32), 0.25 in [32, 64)), so two kernels can order two near-equal candidates
differently. 0.5 nats is two of those steps at the largest logits a model emits, plus the drift that
different reduction orders leave in the hidden state. On the lab pair a broken verify (a relaxed
acceptance rule) emitted tokens 0.7-1.9 nats below the target's top-1, a correct one none off it
(docs/runbook.md#verify_not_lossless). A build that flips near-ties is not lossless either: a correct one
showed 0 near-ties in 288 tokens on the GPU lab, one that flipped every near-tie 50 in 96; more than
``DEFAULT_MAX_NEAR_TIE_RATE`` of the checked tokens fails the check.

The server side it needs: ``POST /tokenize`` (the prompts' ids, so the generation and the check read
the same tokens) and the logprob fields. Only a server without them at all (``/tokenize`` 404, no check
answer carrying the fields) gets ``status: not_checked`` with the reason; the probe fails that unless the
operator allowed it. A server that has them but whose check fails (an HTTP error, a malformed answer, the
fields on some answers only) gets ``status: failed`` with the prompt and the error in ``errors``.

``check_lossless(base_url, prompts)`` is the whole check as one call (tokenize, generate at T = 0,
verify); the live probe runs its parts around its own generation (``sglang_client.tokenize``,
``verify``). Host side: stdlib only (plus our SGLang client, which reads the logprob entries).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ddtree_runtime.health import http_client, sglang_client
from ddtree_runtime.health.sglang_client import (
    BadAnswer,
    logprob_entry,
    read_json,
    token_ids,
    tokenize,
    tokenize_absent,
    top1,
)

DEFAULT_MARGIN = 0.5  # nats; see the module docstring
DEFAULT_MAX_NEAR_TIE_RATE = 0.05  # near-ties per checked token; see the module docstring
TOP_LOGPROBS = 2  # the target's top two per position
MAX_GAPS = 100  # gaps listed in a report (the counts cover every position)
PASSED, FAILED, NOT_CHECKED = "passed", "failed", "not_checked"


class _NotChecked(Exception):
    """The server does not give what the check needs; the message says what is missing."""


@dataclass(frozen=True)
class Generation:
    """One answer to check: the prompt's token ids and the ids the server emitted after them at T = 0."""

    prompt_ids: list[int]
    output_ids: list[int]


@dataclass
class _Tally:
    tokens: int = 0
    mismatches: int = 0
    near_ties: int = 0
    first_mismatch: dict[str, Any] | None = None
    first_near_tie: dict[str, Any] | None = None
    gaps: list[float] | None = None  # nats below the target's top-1, of every token that is not it


def not_checked(reason: str, margin: float = DEFAULT_MARGIN, **extra: Any) -> dict[str, Any]:
    """The report of a check that could not run, with the reason in one line."""
    return {"status": NOT_CHECKED, "reason": reason, "margin_nats": margin, "prompts": 0, "tokens_checked": 0,
            "mismatches": 0, "near_ties": 0, "first_mismatch": None, "first_near_tie": None, "gaps_nats": [],
            "errors": [], **extra}


def check_failed(reason: str, margin: float = DEFAULT_MARGIN, **extra: Any) -> dict[str, Any]:
    """The report of a check a server that claims the fields did not let run: a failure, not a skip."""
    return {**not_checked(reason, margin), "status": FAILED, "errors": [reason], **extra}


def check_request(generations: Sequence[Generation]) -> dict[str, Any]:
    """The one batched /generate that asks the target for its choice at every emitted position."""
    return {
        "input_ids": [g.prompt_ids + g.output_ids for g in generations],
        "sampling_params": {"temperature": 0, "max_new_tokens": 1},
        "return_logprob": True,
        # The first entry SGLang returns is always null; starting one early gives the first emitted token.
        "logprob_start_len": [max(len(g.prompt_ids) - 1, 0) for g in generations],
        "top_logprobs_num": TOP_LOGPROBS,
    }


def verify(base: str, generations: Sequence[Generation], *, margin: float = DEFAULT_MARGIN,
           timeout: float, max_near_tie_rate: float = DEFAULT_MAX_NEAR_TIE_RATE) -> dict[str, Any]:
    """Check the generations against the target's prefill, one request per generation (each stands
    alone). Returns the report dict; raises http_client.HTTPFailure (no answer in time)."""
    if not math.isfinite(margin) or margin < 0:
        raise ValueError(f"margin {margin!r}: pass a non-negative number of nats")
    if not any(g.output_ids for g in generations):
        return check_failed("no generated tokens to check", margin)
    started = time.monotonic()
    answers: list[Any] = []
    for i, gen in enumerate(generations):
        if not gen.output_ids:
            answers.append({"meta_info": {}})
            continue
        status, body = sglang_client.generate(base, check_request([gen]), timeout=timeout)
        doc = read_json(body)
        if status != 200:
            shown = body.decode(errors="replace").replace("\n", " ")[:300]
            answers.append(_CheckError(f"prompt {i}: the check request (return_logprob, max_new_tokens 1) "
                                       f"answered HTTP {status}: {shown}"))
        elif not isinstance(doc, list) or len(doc) != 1:
            answers.append(_CheckError(f"prompt {i}: the check request got {type(doc).__name__} back, not a "
                                       "list of 1 answer"))
        else:
            answers.append(doc[0])
    report = compare_answers(generations, answers, margin, max_near_tie_rate=max_near_tie_rate)
    report["seconds"] = round(time.monotonic() - started, 3)
    return report


class _CheckError:
    """A check request that failed for one generation: the reason, in place of its answer."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def compare_answers(generations: Sequence[Generation], answers: Any, margin: float = DEFAULT_MARGIN, *,
                    max_near_tie_rate: float = DEFAULT_MAX_NEAR_TIE_RATE) -> dict[str, Any]:
    """The report for SGLang's answers to ``check_request(generations)`` (no HTTP). Each answer is judged
    alone: one the check cannot read is an error of its own (``errors``) and never hides another's
    mismatch. ``not_checked`` only when no answer carries the logprob fields at all. Raises BadAnswer
    when the answers are not one per generation."""
    if not isinstance(answers, list) or len(answers) != len(generations):
        raise BadAnswer(f"the batched check request got {type(answers).__name__} back, not a list of "
                        f"{len(generations)} answers")
    tally = _Tally()
    per_prompt: list[dict[str, Any]] = []
    errors: list[str] = []
    absent: list[str] = []  # answers without the logprob fields
    asked = 0
    for i, (gen, answer) in enumerate(zip(generations, answers, strict=True)):
        before = (tally.mismatches, tally.near_ties)
        entry: dict[str, Any] = {"prompt": i, "prompt_tokens": len(gen.prompt_ids),
                                 "tokens": len(gen.output_ids)}
        asked += bool(gen.output_ids)
        try:
            if isinstance(answer, _CheckError):
                raise BadAnswer(answer.reason)
            _compare(i, gen, answer, margin, tally)
        except _NotChecked as exc:
            absent.append(str(exc))
            entry["error"] = str(exc)
        except BadAnswer as exc:
            errors.append(str(exc))
            entry["error"] = str(exc)
        per_prompt.append({**entry, "mismatches": tally.mismatches - before[0],
                           "near_ties": tally.near_ties - before[1]})
    if absent and len(absent) == asked and not errors:
        return not_checked(absent[0], margin, per_prompt=per_prompt)
    if absent:  # fields on some answers and not on others: the server claims them
        errors += [f"the logprob fields are missing from {len(absent)} of {asked} check answers"]
    rate = tally.near_ties / tally.tokens if tally.tokens else 0.0
    reason = None
    if tally.mismatches:
        reason = f"{tally.mismatches} emitted token(s) are not the target's choice"
    elif rate > max_near_tie_rate:
        reason = (f"{tally.near_ties} near-ties in {tally.tokens} tokens ({rate:.1%}, more than "
                  f"{max_near_tie_rate:.1%}): a verify that flips the target's near-ties")
    elif errors:
        reason = f"the check could not run on {len(errors)} answer(s): {errors[0]}"
    return {"status": FAILED if reason else PASSED, "reason": reason, "margin_nats": margin,
            "prompts": len(generations), "tokens_checked": tally.tokens, "mismatches": tally.mismatches,
            "near_ties": tally.near_ties, "near_tie_rate": round(rate, 5),
            "max_near_tie_rate": max_near_tie_rate,
            "first_mismatch": tally.first_mismatch, "first_near_tie": tally.first_near_tie,
            "gaps_nats": sorted(tally.gaps or [])[:MAX_GAPS], "errors": errors[:MAX_GAPS],
            "per_prompt": per_prompt}


def failure_cause(report: dict[str, Any]) -> str | None:
    """The probe's cause for a failed report: a wrong token (or near-ties flipped) is proof the verify is
    not lossless; otherwise the check could not run on a server that claims its fields."""
    if report.get("status") != FAILED:
        return None
    rate, bound = report.get("near_tie_rate") or 0, report.get("max_near_tie_rate")
    if report.get("mismatches") or (bound is not None and rate > bound):
        return "verify_not_lossless"
    return "lossless_check_error"


def _compare(index: int, gen: Generation, answer: Any, margin: float, tally: _Tally) -> None:
    where = f"answer {index} of the check request"
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    if not isinstance(meta, dict):
        raise BadAnswer(f"{where} has no meta_info object")
    m = len(gen.output_ids)
    if m == 0:
        return  # nothing emitted, nothing to check
    tokens, tops = meta.get("input_token_logprobs"), meta.get("input_top_logprobs")
    if tokens is None or tops is None:
        raise _NotChecked("the server's answer has no meta_info.input_token_logprobs / input_top_logprobs "
                          "(SGLang's return_logprob fields): it cannot say what the target would have chosen")
    if not isinstance(tokens, list) or not isinstance(tops, list) or len(tokens) < m or len(tops) < m:
        raise BadAnswer(f"{where}: input_token_logprobs / input_top_logprobs hold fewer than the {m} "
                        "positions asked for")
    # Aligned from the end: the last m entries are the positions of the emitted tokens.
    for k, (entry, top, emitted) in enumerate(zip(tokens[-m:], tops[-m:], gen.output_ids, strict=True)):
        emitted_lp, echoed = logprob_entry(entry, f"{where}: input_token_logprobs[{k - m}]", zero_ok=True)
        if echoed != emitted:
            raise BadAnswer(f"{where}: input_token_logprobs[{k - m}] is {str(entry)[:80]}, not the "
                            f"logprob of the emitted token {emitted}")
        target_lp, target = top1(top, f"{where}: input_top_logprobs[{k - m}]")
        # No logprob (-inf, which SGLang's JSON writes as null): the target gives it probability 0.
        gap = math.inf if emitted_lp is None else target_lp - emitted_lp
        tally.tokens += 1
        if emitted == target or gap <= 0:
            continue
        tally.gaps = [*(tally.gaps or []), round(gap, 5)] if math.isfinite(gap) else (tally.gaps or [])
        found = {"prompt": index, "position": k, "sequence_position": len(gen.prompt_ids) + k,
                 "emitted_token": emitted,
                 "emitted_logprob": None if emitted_lp is None else round(emitted_lp, 5),
                 "target_token": target, "target_logprob": round(target_lp, 5),
                 "gap_nats": round(gap, 5) if math.isfinite(gap) else None,
                 "zero_probability": emitted_lp is None}
        if gap <= margin:
            tally.near_ties += 1
            tally.first_near_tie = tally.first_near_tie or found
        else:
            tally.mismatches += 1
            tally.first_mismatch = tally.first_mismatch or found


def summary(report: dict[str, Any]) -> str:
    """One line for the probe's check and the operator."""
    status, margin = report.get("status"), report.get("margin_nats")
    if status == NOT_CHECKED:
        return f"not checked: {report.get('reason')}"
    counts = (f"{report['tokens_checked']} tokens of {report['prompts']} prompt(s) checked against the "
              f"target's prefill: {report['mismatches']} mismatch(es), {report['near_ties']} near-tie(s) "
              f"within {margin:g} nats")
    first = report.get("first_mismatch")
    if status == FAILED and first:
        lp = first["emitted_logprob"]
        emitted = "probability 0" if lp is None else f"logprob {lp:.3f}"
        apart = "" if first["gap_nats"] is None else f", {first['gap_nats']:.3f} nats apart"
        counts += (f"; first at prompt {first['prompt']} token {first['position']}: emitted "
                   f"{first['emitted_token']} ({emitted}) where the target chooses {first['target_token']} "
                   f"({first['target_logprob']:.3f}){apart}: this build's speculative verify is not lossless")
    elif status == FAILED and report.get("reason"):
        counts += f"; {report['reason']}"
    return counts


def generate_greedy(base: str, prompt_ids: list[int], *, max_new_tokens: int, timeout: float) -> list[int]:
    """The server's T = 0 answer to these ids (what the live probe generates)."""
    sampling = {"temperature": 0, "max_new_tokens": max_new_tokens}
    payload = {"input_ids": prompt_ids, "sampling_params": sampling}
    status, body = sglang_client.generate(base, payload, timeout=timeout)
    doc = read_json(body)
    ids = token_ids(doc.get("output_ids")) if isinstance(doc, dict) else None
    if status != 200 or ids is None:
        shown = body.decode(errors="replace").replace("\n", " ")[:300]
        raise BadAnswer(f"POST /generate answered HTTP {status} without output_ids: {shown}")
    return ids


def check_lossless(base_url: str, prompts: Sequence[str | list[int]], *, max_new_tokens: int = 32,
                   margin: float = DEFAULT_MARGIN, timeout: float = 120.0) -> dict[str, Any]:
    """Generate at T = 0 for each prompt (text, or token ids), then check every emitted token against
    the target's prefill. Returns the report dict::

        {"status": "passed" | "failed" | "not_checked", "reason": str | None, "margin_nats": float,
         "prompts": int, "tokens_checked": int, "mismatches": int, "near_ties": int,
         "first_mismatch": {"prompt", "position", "sequence_position", "emitted_token",
                            "emitted_logprob", "target_token", "target_logprob", "gap_nats"} | None,
         "first_near_tie": {...} | None, "gaps_nats": [float] (how far below the target's top-1 each
         token that is not it lies: the near-tie margin's evidence), "per_prompt": [...], "seconds": float,
         "generations": [{"prompt_ids", "output_ids"}]}

    Raises http_client.HTTPFailure when the server does not answer in ``timeout`` seconds per
    request, BadAnswer when it answers what SGLang never does, ValueError on a bad URL or margin.
    """
    base = http_client.check_base_url(base_url)
    texts = [p for p in prompts if isinstance(p, str)]
    tokenized: list[list[int]] = []
    if texts:
        found, why = tokenize(base, texts, timeout=timeout)
        if found is None:
            return not_checked(why, margin) if tokenize_absent(why) else check_failed(why, margin)
        tokenized = found
    feed = iter(tokenized)
    prompt_ids = [next(feed) if isinstance(p, str) else list(p) for p in prompts]
    generations = [Generation(ids, generate_greedy(base, ids, max_new_tokens=max_new_tokens, timeout=timeout))
                   for ids in prompt_ids]
    report = verify(base, generations, margin=margin, timeout=timeout)
    report["generations"] = [{"prompt_ids": g.prompt_ids, "output_ids": g.output_ids} for g in generations]
    return report
