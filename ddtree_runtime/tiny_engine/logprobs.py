"""SGLang's ``return_logprob`` for the lab engine: the target's log-probabilities of input and output tokens.

What a request asks (``GenerateReqInput.return_logprob``, ``logprob_start_len``, ``top_logprobs_num``) and
what it gets back in ``meta_info``, shaped as SGLang 0.5.23 shapes it:

- ``input_token_logprobs``: ``[logprob, token_id, text]`` for input positions ``logprob_start_len ..``;
  the first entry's logprob is null (SGLang never computes the logit before the start), and
  ``logprob_start_len`` -1 (the default) reports no input position at all;
- ``input_top_logprobs``: per input position the target's top ``top_logprobs_num`` as ``[logprob,
  token_id, text]``, the first entry null;
- ``output_token_logprobs`` / ``output_top_logprobs``: the same for every emitted token, from the logits
  that decided it (the prefill's last position, then each decode round's, or the verify rows of the
  accepted nodes under speculation).

The prompt's entries come from the engine's prefill, which runs no speculative path: the oracle the
lossless check compares a speculative server's output with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

Entry = tuple[float | None, int]


@dataclass(frozen=True)
class LogprobRequest:
    start_len: int = -1  # first input position reported; -1: none (output tokens only)
    top_n: int = 0  # top tokens per position; 0: none


@dataclass
class LogprobRecord:
    top_n: int
    input_tokens: list[Entry] = field(default_factory=list)
    input_top: list[list[Entry] | None] = field(default_factory=list)
    output_tokens: list[Entry] = field(default_factory=list)
    output_top: list[list[Entry]] = field(default_factory=list)

    def add_outputs(self, logits: Tensor, tokens: list[int]) -> None:
        """logits [k, V] that decided tokens[0..k)."""
        lp, top = _entries(logits, tokens, self.top_n)
        self.output_tokens += lp
        self.output_top += top

    def keep_outputs(self, n: int) -> None:
        """The answer was cut to n tokens (stop token, max_new_tokens): so are its logprobs."""
        self.output_tokens, self.output_top = self.output_tokens[:n], self.output_top[:n]

    def meta_info(self) -> dict:
        """The ``meta_info`` fields SGLang adds (token texts null, as without return_text_in_logprobs)."""
        def shown(entries: list[Entry]) -> list[list]:
            return [[lp, token, None] for lp, token in entries]

        meta: dict = {"input_token_logprobs": shown(self.input_tokens),
                      "output_token_logprobs": shown(self.output_tokens),
                      "output_token_logprobs_length": len(self.output_tokens)}
        if self.top_n > 0:
            meta["input_top_logprobs"] = [None if top is None else shown(top) for top in self.input_top]
            meta["output_top_logprobs"] = [shown(top) for top in self.output_top]
        return meta


def record_prompt(request: LogprobRequest, logits: Tensor, prompt: list[int]) -> LogprobRecord:
    """The input part from the prefill's logits [n, V] over the prompt (row i predicts token i + 1)."""
    record = LogprobRecord(request.top_n)
    start = request.start_len
    if start < 0 or start >= len(prompt):
        return record
    lp, top = _entries(logits[start : len(prompt) - 1], prompt[start + 1 :], request.top_n)
    record.input_tokens = [(None, prompt[start]), *lp]
    record.input_top = [None, *top]
    return record


def _entries(logits: Tensor, tokens: list[int], top_n: int) -> tuple[list[Entry], list[list[Entry]]]:
    if not tokens:
        return [], []
    logp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(tokens, device=logits.device)
    chosen = logp.gather(1, ids[:, None])[:, 0].tolist()
    token_entries: list[Entry] = [(float(v), t) for v, t in zip(chosen, tokens, strict=True)]
    if top_n <= 0:
        return token_entries, [[] for _ in tokens]
    values, top_ids = logp.topk(min(top_n, logp.shape[-1]), dim=-1)
    tops = [[(float(v), int(t)) for v, t in zip(vs, ts, strict=True)]
            for vs, ts in zip(values.tolist(), top_ids.tolist(), strict=True)]
    return token_entries, tops
