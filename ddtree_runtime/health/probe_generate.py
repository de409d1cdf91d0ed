"""The live probe's generation: the prompts at T=0 one at a time, then all of them as one batch, each
answer as many tokens as asked (fewer only where a stop token ended it). Host side: stdlib only.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ddtree_runtime.health import diagnose, sglang_client
from ddtree_runtime.health.http_client import HTTPFailure
from ddtree_runtime.health.probe_report import Report, check_exchange
from ddtree_runtime.health.sglang_client import BadAnswer, is_int, read_json

MAX_AT_ONCE = 64  # prompts sent together in the batch run (SGLang's default max running requests is 48+)


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
        check_exchange(report, "generate", answer)
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


def generate_answers(base: str, prompts: list[str], max_new_tokens: int, timeout: float, report: Report,
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
