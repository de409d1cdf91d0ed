"""The tiny engine: its decoder (``decoder``) serving requests, SGLang-style continuous batching. New
requests are prefilled and join a running batch between rounds, finished ones leave with their result; stop
tokens and ``max_new_tokens`` end a request as SGLang's do. ``TinyEngine.generate`` runs a list of requests
to completion; the server (``server``) keeps one batch running and feeds it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ddtree_runtime.tiny_engine.decoder import DraftState, SamplingParams, TinyDecoder
from ddtree_runtime.tiny_engine.kv_cache import KVCache
from ddtree_runtime.tiny_engine.logprobs import LogprobRecord, LogprobRequest, record_prompt
from ddtree_runtime.tiny_engine.models import causal_mask


@dataclass
class GenerationResult:
    output_ids: list[int]
    finish_reason: dict
    prompt_tokens: int
    verify_ct: int = 0  # speculative rounds this request took part in
    accepted_sum: int = 0  # sum of tau (accepted drafts + bonus) over those rounds
    accept_lengths: list[int] = field(default_factory=list)
    logprobs: LogprobRecord | None = None  # return_logprob requests only

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def accept_length(self) -> float:
        return self.accepted_sum / self.verify_ct if self.verify_ct else 0.0


class TinyEngine(TinyDecoder):
    """The decoder plus requests: `generate` runs a batch of requests to completion; `new_batch` starts a
    running batch that requests join and leave between rounds."""

    def new_batch(self) -> RunningBatch:
        return RunningBatch(self)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerationResult]:
        """Run these requests as one batch to completion."""
        batch = self.new_batch()
        requests = batch.admit(prompts, params)
        while len(batch):
            batch.step()
        return [r.result for r in requests]

    def _finished(self, out: list[int], p: SamplingParams) -> bool:
        if len(out) >= p.max_new_tokens:
            return True
        return bool(self._stop_ids(p).intersection(out))

    def _stop_ids(self, p: SamplingParams) -> set[int]:
        stops = set(p.stop_token_ids)
        if not p.ignore_eos:
            stops.add(self.tokenizer.eos_token_id)
        return stops

    def _truncate(self, out: list[int], p: SamplingParams) -> tuple[list[int], dict]:
        stops = self._stop_ids(p)
        for i, t in enumerate(out[: p.max_new_tokens]):
            if t in stops:
                return out[: i + 1], {"type": "stop", "matched": t}
        out = out[: p.max_new_tokens]
        return out, {"type": "length", "length": len(out)}


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    result: GenerationResult
    tag: object = None  # the caller's handle
    output: list[int] = field(default_factory=list)
    logprob: LogprobRequest | None = None
    cf_slot: int | None = None  # the counterfactual scorer's slot, while the request runs


class RunningBatch:
    """Requests decoding together, SGLang-style continuous batching: new requests are prefilled and join
    between rounds; finished ones leave. Rows of every tensor (KV caches, lengths, roots) follow
    `self.requests`."""

    def __init__(self, engine: TinyEngine) -> None:
        self.engine = engine
        self.requests: list[Request] = []
        self.cache: KVCache | None = None
        self.draft: DraftState | None = None
        self.lens = self.roots = torch.zeros(0, dtype=torch.long, device=engine.device)

    def __len__(self) -> int:
        return len(self.requests)

    @torch.no_grad()
    def admit(self, prompts: list[list[int]], params: list[SamplingParams], tags=None,
              logprobs: list[LogprobRequest | None] | None = None) -> list[Request]:
        """Prefill new requests (their first token is decided here) and add them to the batch.
        ``logprobs``: per request, what SGLang's return_logprob asks (None: nothing)."""
        eng = self.engine
        if len(prompts) != len(params):
            raise ValueError("one SamplingParams per prompt")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        tags = list(tags) if tags is not None else [None] * len(prompts)
        logprobs = list(logprobs) if logprobs is not None else [None] * len(prompts)
        reqs = [
            Request(list(p), sp, GenerationResult([], {"type": "length", "length": 0}, len(p)), tag,
                    logprob=lp)
            for p, sp, tag, lp in zip(prompts, params, tags, logprobs, strict=True)
        ]
        eng.stats.prompt_tokens += sum(len(p) for p in prompts)
        todo = [r for r in reqs if r.params.max_new_tokens > 0]
        if not todo:
            return reqs
        dev = eng.device
        b = len(todo)
        lens = torch.tensor([len(r.prompt) for r in todo], device=dev)
        n = int(lens.max())
        cache = eng.target.new_cache(b, self._capacity_for(todo))
        ids = torch.zeros((b, n), dtype=torch.long, device=dev)
        for i, r in enumerate(todo):
            ids[i, : len(r.prompt)] = torch.tensor(r.prompt, device=dev)
        positions = torch.arange(n, device=dev)[None].expand(b, -1)
        logits, feats = eng._target_forward(
            ids, positions, causal_mask(n, dev)[None].expand(b, -1, -1), cache, positions, lens, "prefill"
        )
        cache.commit_recurrent(lens - 1)  # GDN layers: the state after each prompt's last token
        last = logits.gather(1, (lens - 1)[:, None, None].expand(-1, 1, logits.shape[-1]))[:, 0]
        roots = eng._decide(last[:, None], [r.params for r in todo])[:, 0]
        for i, (r, t) in enumerate(zip(todo, roots.tolist(), strict=True)):
            r.output.append(int(t))
            if r.logprob is not None:
                r.result.logprobs = record_prompt(r.logprob, logits[i, : len(r.prompt)], r.prompt)
                r.result.logprobs.add_outputs(last[i : i + 1], [int(t)])
        for r in todo:
            r.cf_slot = eng.counterfactual_slot()
        draft = None
        if eng.draft is not None:
            draft = eng.new_draft_state(b, cache.capacity)
            draft.pending = (feats, lens.clone())
        self._merge(todo, cache, draft, lens, roots)
        return reqs

    def _capacity_for(self, reqs: list[Request]) -> int:
        eng = self.engine
        per_round = eng.num_draft_tokens + (eng.block_size if eng.draft is not None else 1)
        return max(len(r.prompt) + r.params.max_new_tokens for r in reqs) + per_round + 2

    def _merge(self, reqs, cache: KVCache, draft: DraftState | None, lens: Tensor, roots: Tensor) -> None:
        if self.cache is None or not self.requests:
            self.requests, self.cache, self.draft, self.lens, self.roots = (
                list(reqs),
                cache,
                draft,
                lens,
                roots,
            )
            return
        capacity = max(self.cache.capacity, cache.capacity)
        self.cache.extend(cache, capacity)
        if self.draft is not None and draft is not None:
            self.draft.extend(draft, capacity)
        self.requests += reqs
        self.lens, self.roots = torch.cat([self.lens, lens]), torch.cat([self.roots, roots])

    @torch.no_grad()
    def step(self) -> list[Request]:
        """One decode round for every running request; returns the requests that finished (removed)."""
        eng = self.engine
        done = self._reap()
        if not self.requests:
            return done
        params = [r.params for r in self.requests]
        if eng.draft is None:
            emitted, nums, self.lens, deciding = eng._ar_round(self.cache, self.lens, self.roots, params)
        else:
            emitted, nums, self.lens, deciding = eng._spec_round(
                self.cache, self.draft, self.lens, self.roots, params, [r.cf_slot for r in self.requests]
            )
            for r, k in zip(self.requests, nums.tolist(), strict=True):
                r.result.verify_ct += 1
                r.result.accepted_sum += k
                r.result.accept_lengths.append(k)
        self.roots = emitted.gather(1, (nums - 1)[:, None])[:, 0]
        for i, (r, row, k) in enumerate(zip(self.requests, emitted.tolist(), nums.tolist(), strict=True)):
            r.output.extend(row[:k])
            if r.result.logprobs is not None:
                r.result.logprobs.add_outputs(deciding[i, :k], row[:k])
        if eng.on_round is not None:
            eng.on_round(len(self.requests), sum(len(r.prompt) + len(r.output) for r in self.requests))
        return done + self._reap()

    def _reap(self) -> list[Request]:
        eng = self.engine
        done = [r for r in self.requests if eng._finished(r.output, r.params)]
        if not done:
            return []
        keep = [i for i, r in enumerate(self.requests) if r not in done]
        for r in done:
            eng.release_counterfactual_slot(r.cf_slot)
            r.cf_slot = None
            r.result.output_ids, r.result.finish_reason = eng._truncate(r.output, r.params)
            if r.result.logprobs is not None:
                r.result.logprobs.keep_outputs(len(r.result.output_ids))
            eng.stats.generated_tokens += r.result.completion_tokens
        self.requests = [self.requests[i] for i in keep]
        if self.requests:
            sel = torch.tensor(keep, device=eng.device)
            self.cache.select(sel)
            self.lens, self.roots = self.lens[sel], self.roots[sel]
            if self.draft is not None:
                self.draft.select(sel)
        return done
