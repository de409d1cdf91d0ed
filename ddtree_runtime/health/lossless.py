"""Is a speculative server lossless? The target's own prefill is the oracle.

At T = 0 every token a speculative server emits must be the target's greedy choice after the tokens
before it. A prefill of the prompt plus the emitted tokens runs no speculative path (no draft, no tree,
no verify mask, no KV commit): its per-position top-1 is what the target chooses there. So the check
sends, for every answer, ``prompt ids + emitted ids`` back as ``input_ids`` with SGLang 0.5.23's logprob
fields (``return_logprob``, ``logprob_start_len`` = prompt length - 1, ``top_logprobs_num`` 2,
``max_new_tokens`` 1: a prefill, never a decode) and compares position by position
``meta_info.input_top_logprobs`` (the target's top two) with the token the server emitted there
(``meta_info.input_token_logprobs`` echoes it with its logprob). All answers go in one batched request.

Near-ties are not failures. A position whose emitted token is not the target's top-1 but within
``margin`` nats of it (``DEFAULT_MARGIN``) is a near-tie: a verify and a prefill run different kernels
(tree-masked verify attention over B+1 rows vs. the extend path over the whole sequence, other tile
sizes and reduction orders), and in bf16 a logit is only stored to 8 significant bits (the spacing is
0.125 for logits in [16, 32), 0.25 in [32, 64)), so two kernels can order two near-equal candidates
differently. 0.5 nats is two of those steps at the largest logits a model emits, plus the drift that
different reduction orders leave in the hidden state. On the lab pair a broken verify (a relaxed
acceptance rule) emitted tokens 0.7-1.9 nats below the target's top-1, a correct one none off it
(docs/runbook.md#verify_not_lossless).

The server side it needs: ``POST /tokenize`` (the prompts' ids, so the generation and the check read
the same tokens) and the logprob fields. A server without them gets ``status: not_checked`` with the
reason: never a silent pass and never a false failure.

``check_lossless(base_url, prompts)`` is the whole check as one call (tokenize, generate at T = 0,
verify); the live probe runs its parts around its own generation (``tokenize``, ``verify``). Host
side: stdlib only (plus our http_client).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ddtree_runtime.health import http_client

DEFAULT_MARGIN = 0.5  # nats; see the module docstring
TOP_LOGPROBS = 2  # the target's top two per position
MAX_GAPS = 100  # gaps listed in a report (the counts cover every position)
PASSED, FAILED, NOT_CHECKED = "passed", "failed", "not_checked"


class BadAnswer(ValueError):
    """An answer SGLang 0.5.23 never gives (wrong types, misaligned logprobs): the probe's bad_response."""


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
            **extra}


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def _ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in value):
        return value
    return None


def tokenize(base: str, prompts: Sequence[str], *, timeout: float) -> tuple[list[list[int]] | None, str]:
    """The server's token ids of each prompt (SGLang's ``POST /tokenize``, what ``/generate`` reads a
    text as), or (None, why not). Raises http_client.HTTPFailure when the server does not answer."""
    status, body = http_client.request(f"{base}/tokenize", payload={"prompt": list(prompts)}, timeout=timeout)
    doc = _json(body)
    if status != 200 or not isinstance(doc, dict):
        return None, (f"POST /tokenize answered HTTP {status}" + ("" if status != 200 else " but not a JSON "
                      "object") + ": the server cannot say which token ids it reads the prompts as")
    tokens = doc.get("tokens")
    ids = [_ids(t) for t in tokens] if isinstance(tokens, list) and len(tokens) == len(prompts) else None
    if ids is None or any(t is None for t in ids):
        return None, "POST /tokenize answered 200 without one non-empty list of token ids per prompt"
    return [list(t) for t in ids if t is not None], ""


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
           timeout: float) -> dict[str, Any]:
    """Check the generations against the target's prefill (one request). Returns the report dict;
    raises http_client.HTTPFailure (no answer) or BadAnswer (an answer SGLang never gives)."""
    if not math.isfinite(margin) or margin < 0:
        raise ValueError(f"margin {margin!r}: pass a non-negative number of nats")
    if not any(g.output_ids for g in generations):
        return not_checked("no generated tokens to check", margin)
    started = time.monotonic()
    status, body = http_client.request(f"{base}/generate", payload=check_request(generations),
                                       timeout=timeout)
    seconds = round(time.monotonic() - started, 3)
    if status != 200:
        shown = body.decode(errors="replace").replace("\n", " ")[:300]
        return not_checked(f"the check request (return_logprob, max_new_tokens 1) answered HTTP {status}: "
                           f"{shown}", margin, seconds=seconds)
    doc = _json(body)
    report = compare_answers(generations, doc, margin)
    report["seconds"] = seconds
    return report


def compare_answers(generations: Sequence[Generation], answers: Any, margin: float = DEFAULT_MARGIN
                    ) -> dict[str, Any]:
    """The report for SGLang's answers to ``check_request(generations)`` (no HTTP). Raises BadAnswer."""
    if not isinstance(answers, list) or len(answers) != len(generations):
        raise BadAnswer(f"the batched check request got {type(answers).__name__} back, not a list of "
                        f"{len(generations)} answers")
    tally = _Tally()
    per_prompt = []
    try:
        for i, (gen, answer) in enumerate(zip(generations, answers, strict=True)):
            before = (tally.mismatches, tally.near_ties)
            _compare(i, gen, answer, margin, tally)
            per_prompt.append({"prompt": i, "prompt_tokens": len(gen.prompt_ids),
                               "tokens": len(gen.output_ids), "mismatches": tally.mismatches - before[0],
                               "near_ties": tally.near_ties - before[1]})
    except _NotChecked as exc:
        return not_checked(str(exc), margin)
    return {"status": FAILED if tally.mismatches else PASSED, "reason": None, "margin_nats": margin,
            "prompts": len(generations), "tokens_checked": tally.tokens, "mismatches": tally.mismatches,
            "near_ties": tally.near_ties, "first_mismatch": tally.first_mismatch,
            "first_near_tie": tally.first_near_tie, "gaps_nats": sorted(tally.gaps or [])[:MAX_GAPS],
            "per_prompt": per_prompt}


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
        emitted_lp, echoed = _logprob_entry(entry, f"{where}: input_token_logprobs[{k - m}]")
        if echoed != emitted or emitted_lp is None:
            raise BadAnswer(f"{where}: input_token_logprobs[{k - m}] is {str(entry)[:80]}, not the "
                            f"logprob of the emitted token {emitted}")
        target_lp, target = _top1(top, f"{where}: input_top_logprobs[{k - m}]")
        gap = target_lp - emitted_lp
        tally.tokens += 1
        if emitted == target or gap <= 0:
            continue
        tally.gaps = [*(tally.gaps or []), round(gap, 5)]
        found = {"prompt": index, "position": k, "sequence_position": len(gen.prompt_ids) + k,
                 "emitted_token": emitted, "emitted_logprob": round(emitted_lp, 5), "target_token": target,
                 "target_logprob": round(target_lp, 5), "gap_nats": round(gap, 5)}
        if gap <= margin:
            tally.near_ties += 1
            tally.first_near_tie = tally.first_near_tie or found
        else:
            tally.mismatches += 1
            tally.first_mismatch = tally.first_mismatch or found


def _logprob_entry(entry: Any, where: str) -> tuple[float | None, int]:
    """SGLang's [logprob, token_id, text-or-null]: (logprob or None, token id)."""
    if not isinstance(entry, list) or len(entry) < 2 or not _is_id(entry[1]):
        raise BadAnswer(f"{where} is {str(entry)[:80]}, not [logprob, token_id, text]")
    lp = entry[0]
    if lp is None:
        return None, entry[1]
    if isinstance(lp, bool) or not isinstance(lp, int | float) or not math.isfinite(lp) or lp > 1e-3:
        raise BadAnswer(f"{where} has logprob {str(lp)[:40]}, not a finite log-probability")
    return float(lp), entry[1]


def _top1(top: Any, where: str) -> tuple[float, int]:
    if not isinstance(top, list) or not top:
        raise BadAnswer(f"{where} is {str(top)[:80]}, not a list of the target's top tokens")
    best: tuple[float, int] | None = None
    for entry in top:
        lp, token = _logprob_entry(entry, where)
        if lp is None:
            raise BadAnswer(f"{where} lists token {token} without a logprob")
        if best is None or lp > best[0] or (lp == best[0] and token < best[1]):
            best = (lp, token)
    assert best is not None
    return best


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


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
        counts += (f"; first at prompt {first['prompt']} token {first['position']}: emitted "
                   f"{first['emitted_token']} (logprob {first['emitted_logprob']:.3f}) where the target "
                   f"chooses {first['target_token']} ({first['target_logprob']:.3f}), "
                   f"{first['gap_nats']:.3f} nats apart: this build's speculative verify is not lossless")
    return counts


def generate_greedy(base: str, prompt_ids: list[int], *, max_new_tokens: int, timeout: float) -> list[int]:
    """The server's T = 0 answer to these ids (what the live probe generates)."""
    sampling = {"temperature": 0, "max_new_tokens": max_new_tokens}
    payload = {"input_ids": prompt_ids, "sampling_params": sampling}
    status, body = http_client.request(f"{base}/generate", payload=payload, timeout=timeout)
    doc = _json(body)
    ids = _ids(doc.get("output_ids")) if isinstance(doc, dict) else None
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
            return not_checked(why, margin)
        tokenized = found
    feed = iter(tokenized)
    prompt_ids = [next(feed) if isinstance(p, str) else list(p) for p in prompts]
    generations = [Generation(ids, generate_greedy(base, ids, max_new_tokens=max_new_tokens, timeout=timeout))
                   for ids in prompt_ids]
    report = verify(base, generations, margin=margin, timeout=timeout)
    report["generations"] = [{"prompt_ids": g.prompt_ids, "output_ids": g.output_ids} for g in generations]
    return report
