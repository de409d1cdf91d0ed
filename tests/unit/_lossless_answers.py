"""Answers to the lossless check's request shaped as SGLang 0.5.23 shapes them (read from the real server
on CPU): with ``logprob_start_len`` s, ``input_token_logprobs[j]`` is ``[logprob, token_id, null]`` of input
position s + j and ``input_top_logprobs[j]`` the target's top tokens there, both null at j = 0."""

from __future__ import annotations

from ddtree_runtime.health.lossless import Generation

PROMPT = [84, 104, 101, 32]


def answer(gen: Generation, tops: list[list[tuple[float, int]]], *, emitted_lp: list[float] | None = None,
           start: int | None = None) -> dict:
    """SGLang's answer to check_request([gen]): ``tops[k]`` = the target's top tokens where output k sits."""
    start = len(gen.prompt_ids) - 1 if start is None else start
    seq = gen.prompt_ids + gen.output_ids
    p = len(gen.prompt_ids)
    token_lp, top_lp = [[None, seq[start], None]], [None]
    for pos in range(start + 1, len(seq)):
        k = pos - p
        top = tops[k] if k >= 0 else [(-1.0, 7), (-2.0, 8)]
        lp = emitted_lp[k] if k >= 0 and emitted_lp else dict((t, v) for v, t in top).get(seq[pos], -9.0)
        token_lp.append([lp, seq[pos], None])
        top_lp.append([[v, t, None] for v, t in top])
    return {"text": "x", "output_ids": [seq[-1]], "meta_info": {
        "input_token_logprobs": token_lp, "input_top_logprobs": top_lp, "output_token_logprobs": [],
        "completion_tokens": 1}}
