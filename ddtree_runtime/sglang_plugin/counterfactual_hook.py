"""Counterfactual acceptance on the live worker: the scorer (``core/counterfactual.py``) fed by SGLang's
decode rounds, so that ``ddtree tune --url`` and ``ddtree fleet status`` read a production server.

Per decode round (``DDTreeWorker.forward_batch_generation``), three steps:

* :meth:`CounterfactualHook.plan`, on the host before the round: a host round counter decides whether this
  round is sampled (every ``1 / fraction``-th greedy decode round, evenly spaced; every greedy row of the
  batch then is). A round that is not sampled and whose rows have nothing pending returns None: no device
  work at all. Rows are greedy when SGLang's own host field says so (``sampling_params.top_k <= 1``, what
  its ``is_all_greedy`` is made of); T > 0 rows are never sampled (docs/counterfactual-acceptance.md).
  Slots are ``req.kv.req_pool_idx``: a slot whose pending rounds belong to another request, or to one
  that left the decode batch (finished or retracted), is released first, so a new request is never scored
  against the old one's tokens.
* the drafter's top-K of a sampled round, read eagerly and only then:

  - the tree round run eagerly: the round's ``draft_block`` output (:class:`TeeDraftBlock` around the
    round's models), full logits or a vocabulary-parallel head's merged top-K;
  - the tree round's graphs (``round/round_graphs.py``): the plan graph keeps the drafter's depth rows in
    its bucket's static buffer; after the round they go through the same head (``RoundBucket.depth_logits``,
    the bucket's shape, so the logits are the graph's bit for bit) — the graphs capture nothing more;
  - the chain (DFlash's own decode): the drafter pass's hidden rows, teed from ``draft_model_runner.forward``
    and ranked by the plugin's head (DFlash's own greedy head, folded into the draft graph or not, is
    untouched);
* :meth:`end`: the round's emitted tokens and counts (the result SGLang gets) into the scorer.

Nothing here reads the device: the sampling decision is the host's, releases and masks go host -> device
through pinned memory without waiting, and the counters reach ``/metrics`` through
:class:`CounterPublisher` (an asynchronous copy at most every few seconds; a plain read when the scheduler
is idle). With fraction 0 the worker builds none of this (``build_scoring`` returns None).

Per-round work is bounded: a sampled round builds every candidate's tree for the batch; a round that only
feeds pending rounds runs the scorer's match over ``batch x ring x candidates x max budget``; a slot needs
feeding for at most ``horizon`` rounds after its last sampled round (each round emits a token, so by then
every pending round is resolved); the host tracks that, so later rounds cost nothing.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ddtree_runtime.core.counterfactual import Candidate, CounterfactualScorer
from ddtree_runtime.core.tree_types import DraftTopK, topk_width
from ddtree_runtime.sglang_plugin.round.readback import copy_to_host

logger = logging.getLogger(__name__)


def is_greedy(req: Any) -> bool:
    """SGLang's host-side greedy rule (temperature 0 becomes top_k 1 in SamplingParams.normalize)."""
    return int(req.sampling_params.top_k) <= 1


def slot_of(req: Any) -> int:
    """The request's ``req_to_token`` row (0.5.23 keeps it on ``req.kv``), host-side."""
    kv = getattr(req, "kv", None)
    return int(kv.req_pool_idx if kv is not None else req.req_pool_idx)


def to_device(values: Sequence[int] | Sequence[bool], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small host list on the device without waiting for it (pinned memory, non-blocking)."""
    host = torch.tensor(list(values), dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def stop_table(stops: Sequence[frozenset[int]], device: torch.device) -> Tensor:
    """The rows' stop sets as ``[b, S]`` int64 on the device (-2 where a row has fewer), copied without
    waiting."""
    width = max(1, max(len(s) for s in stops))
    host = torch.full((len(stops), width), -2, dtype=torch.long)
    for r, ids in enumerate(stops):
        if ids:
            host[r, : len(ids)] = torch.tensor(sorted(ids), dtype=torch.long)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def ends_at_stop(emitted: Tensor, num_emitted: Tensor, stops: Tensor) -> Tensor:
    """``[b]`` bool: the row emitted one of its stop tokens this round (its request stops with it; the
    round's walk is cut there, ``tree_round.truncate_at_stop``). Device ops only."""
    live = torch.arange(emitted.shape[1], device=emitted.device)[None] < num_emitted[:, None]
    return ((emitted[:, :, None] == stops[:, None, :]).any(-1) & live).any(-1)


def head_candidates(candidates: Sequence[Candidate], head_k: int | None, vocab: int) -> list[Candidate]:
    """The candidates a head ranking ``head_k`` tokens per depth can build whole (None: it ranks as many as
    asked). A tree of budget B and cap c needs min(B, V, c) per depth; a narrower top-K would give it a
    narrower tree than it builds, so those candidates are not scored (and not on /metrics)."""
    if head_k is None:
        return list(candidates)
    return [c for c in candidates if topk_width(c.budget, vocab, c.topk_cap) <= head_k]


class RoundSampler:
    """Which decode rounds are sampled, from a host counter only: round n is sampled when
    ``floor(n * fraction)`` steps up, so exactly ``fraction`` of rounds, evenly spaced, the same rounds on
    every rank of a TP group (a vocabulary-parallel head's exchange runs on all of them or none)."""

    def __init__(self, fraction: float) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"a sampled fraction must be in (0, 1], got {fraction}")
        self.fraction = float(fraction)
        self.rounds = 0

    def next(self) -> bool:
        n = self.rounds
        self.rounds += 1
        return math.floor((n + 1) * self.fraction) > math.floor(n * self.fraction)


@dataclass
class RoundPlan:
    """One decode round's scoring, decided on the host."""

    sampled: bool  # build and register every candidate's tree this round
    slots: Tensor  # [b] the batch's req_pool_indices (device)
    sample: Tensor | None  # [b] bool, greedy rows (device); None when not sampled
    rows: int
    top: DraftTopK | None = None  # the drafter's top-K, filled on a sampled round
    stops: Tensor | None = None  # [b, S] the rows' stop tokens (-2 padded), None: no row has any


@dataclass
class SlotBook:
    """Host bookkeeping per slot that may hold pending rounds: its request and how many of its rounds may
    still feed them (``horizon`` after the last sampled round)."""

    horizon: int
    owner: dict[int, Any] = field(default_factory=dict)
    left: dict[int, int] = field(default_factory=dict)

    def stale(self, slots: list[int], reqs: Sequence[Any]) -> list[int]:
        """Slots to release before this round, forgotten here: reused by another request, or whose request
        is not in this decode batch (it finished, or was retracted: a re-prefill emits a token the scorer
        never sees). A decode batch holds every decoding request (DDTREE turns mixed chunks off), so absence
        means the request left."""
        here = dict(zip(slots, reqs, strict=True))
        out = [s for s, req in self.owner.items() if here.get(s) is not req]
        for s in out:
            self.owner.pop(s, None)
            self.left.pop(s, None)
        return out

    def advance(self, slots: list[int], reqs: Sequence[Any], sampled_rows: list[bool]) -> bool:
        """Count this round against each row's slot; whether any row feeds a pending round."""
        feed = False
        for s, req, sampled in zip(slots, reqs, sampled_rows, strict=True):
            if sampled:
                feed = True
                self.owner[s] = req
                self._set(s, self.horizon - 1)  # this round feeds it first
            elif s in self.left:
                feed = True
                self._set(s, self.left[s] - 1)
        return feed

    def _set(self, slot: int, left: int) -> None:
        if left > 0:
            self.left[slot] = left
        else:  # resolved on the device by now: nothing pending to go stale
            self.left.pop(slot, None)
            self.owner.pop(slot, None)


class CounterfactualHook:
    """The worker's scorer and its per-round decisions (see module doc)."""

    def __init__(
        self,
        candidates: Sequence[Candidate],
        *,
        fraction: float,
        horizon: int,
        num_slots: int,
        device: torch.device | str,
    ) -> None:
        self.sampler = RoundSampler(fraction)
        self.horizon = int(horizon)
        self.scorer = CounterfactualScorer(candidates, horizon=horizon, num_slots=num_slots, device=device)
        self.device = self.scorer.device
        self.book = SlotBook(self.horizon)
        self.rounds_observed = 0  # host count of observe calls: the publisher's "anything new?"
        self._stops: tuple[tuple[frozenset[int], ...], Tensor] | None = None  # the last batch's, on device

    def plan(
        self,
        reqs: Sequence[Any],
        req_pool_indices: Tensor,
        stop_of: Callable[[Any], frozenset[int]] | None = None,
    ) -> RoundPlan | None:
        """Host decision before the round (None: nothing to do this round). ``stop_of(req)``: a request's
        stop tokens, the round's own rule (``ddtree_info.stop_ids``): a row that emits one ends its
        request, and the scorer is told (``CounterfactualScorer.observe``'s ``ends``)."""
        sampled = self.sampler.next()
        greedy = [is_greedy(r) for r in reqs] if sampled else []
        sampled = sampled and any(greedy)
        if not sampled and not self.book.left:
            return None
        slots = [slot_of(r) for r in reqs]
        stale = self.book.stale(slots, reqs)
        if stale:
            self.scorer.release(to_device(stale, torch.long, self.device))
        if not self.book.advance(slots, reqs, greedy if sampled else [False] * len(reqs)):
            return None
        sample = None
        if sampled:
            if all(greedy):
                sample = torch.ones(len(reqs), dtype=torch.bool, device=self.device)
            else:
                sample = to_device(greedy, torch.bool, self.device)
        table = None
        stops = None if stop_of is None else tuple(stop_of(r) for r in reqs)
        if stops is not None and any(stops):
            key = stops
            if self._stops is None or self._stops[0] != key:  # the batch's sets change only as it does
                self._stops = (key, stop_table(key, self.device))
            table = self._stops[1]
        return RoundPlan(sampled=sampled, slots=req_pool_indices, sample=sample, rows=len(reqs), stops=table)

    # --- the drafter's top-K of a sampled round ------------------------------------------------
    def take_head(self, plan: RoundPlan, head: Tensor | DraftTopK, block: int) -> None:
        """The eager tree round's head output: full logits ``[b * block, V]`` (slot 0 is the root, not
        read) or a vocabulary-parallel head's merged top-K ``[b, block - 1, K]``."""
        if not plan.sampled:
            return
        if isinstance(head, DraftTopK):
            plan.top = head  # K covers every scored candidate (head_candidates at construction)
            return
        plan.top = self.scorer.top_from_logits(head.view(plan.rows, block, -1)[:, 1:])

    def take_depth_logits(self, plan: RoundPlan, logits: Tensor) -> None:
        """The depth logits ``[b, L, V]`` of a round whose plan ran in a graph
        (``RoundBucket.depth_logits``)."""
        if plan.sampled and plan.top is None:
            plan.top = self.scorer.top_from_logits(logits)

    def take_hidden(
        self, plan: RoundPlan, hidden: Tensor, rank: Callable[[Tensor, int], Tensor | DraftTopK]
    ) -> None:
        """The chain: the drafter's depth rows ``hidden [b * L, H]`` ranked by ``rank(hidden, k)``
        (``draft_head``: full logits, or the TP group's merged top-K of width k)."""
        if not plan.sampled or plan.top is not None:
            return
        head = rank(hidden, self.scorer.max_budget)
        if isinstance(head, DraftTopK):
            plan.top = head.reshape(plan.rows, self.horizon)
        else:
            plan.top = self.scorer.top_from_logits(head.view(plan.rows, self.horizon, -1))

    # --- after the round -----------------------------------------------------------------------
    def end(self, plan: RoundPlan, emitted: Tensor, num_emitted: Tensor) -> None:
        """``emitted [b * W]`` (the round's committed tokens in order, -1 padded) and ``num_emitted [b]``.
        A sampled round whose top-K never came (no drafter output to rank) only feeds."""
        top = plan.top if plan.sampled else None
        rows = emitted.view(plan.rows, -1)
        ends = None if plan.stops is None else ends_at_stop(rows, num_emitted, plan.stops)
        self.scorer.observe(top, rows, num_emitted, plan.slots, plan.sample, ends)
        self.rounds_observed += 1


class TeeDraftBlock:
    """``tree_round.RoundModels`` that hands the eager round's drafter head output to ``take`` as well
    (``draft_hidden``, the graph path's, passes through: the hook reads the bucket after the round)."""

    def __init__(self, models: Any, take: Callable[[Tensor | DraftTopK], None]) -> None:
        self._models, self._take = models, take

    def draft_block(self, *args: Any, **kwargs: Any) -> Tensor | DraftTopK:
        out = self._models.draft_block(*args, **kwargs)
        self._take(out)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._models, name)


class CounterPublisher:
    """The scorer's counters to ``sink(snapshot)`` without a host sync on the decode path: after a round,
    at most every ``interval_s``, an asynchronous copy of :meth:`CounterfactualScorer.counter_vector` into
    (pinned) host memory, published at a later round once its event has completed; :meth:`flush` reads them
    directly (the scheduler is idle then, nothing to wait for). ``async_copy``: copy and wait for the event
    (default: where the scorer is on CUDA; a scorer on the host is read at once)."""

    def __init__(
        self,
        hook: CounterfactualHook,
        sink: Callable[[dict], None],
        interval_s: float = 2.0,
        clock: Callable[[], float] | None = None,
        async_copy: bool | None = None,
    ) -> None:
        import time

        self.hook, self.sink, self.interval_s = hook, sink, interval_s
        self.clock = clock or time.monotonic
        self.async_copy = hook.device.type == "cuda" if async_copy is None else async_copy
        self._next = 0.0
        self._published = -1  # rounds_observed at the last publish
        self._copy: tuple[Tensor, Any, int] | None = None  # (host buffer, event, rounds_observed)
        self._host: Tensor | None = None  # the copy's host buffer, allocated once (one copy at a time)

    def after_round(self) -> None:
        if self._copy is not None and self._copy[1].query():
            host, _, seen = self._copy
            self._copy = None
            self._publish(host.tolist(), seen)  # a host tensor: no device read
        now = self.clock()
        if now < self._next or self._copy is not None or self.hook.rounds_observed == self._published:
            return
        self._next = now + self.interval_s
        vec = self.hook.scorer.counter_vector()
        if not self.async_copy:
            self._publish(vec.tolist(), self.hook.rounds_observed)  # on the host: the values are here
            return
        if self._host is None:
            self._host = torch.empty(vec.shape, dtype=vec.dtype, pin_memory=vec.device.type == "cuda")
        self._copy = (self._host, copy_to_host(vec, self._host), self.hook.rounds_observed)

    def flush(self) -> None:
        """Scheduler idle: publish what the scorer holds now if anything changed."""
        if self.hook.rounds_observed == self._published:
            return
        self._copy = None
        self._publish(self.hook.scorer.counter_vector().tolist(), self.hook.rounds_observed)

    def _publish(self, values: list[float], seen: int) -> None:
        self.sink(self.hook.scorer.snapshot_from(values))
        self._published = seen


class WorkerScoring:
    """What ``DDTreeWorker`` holds: the hook, its publisher, and the round in flight."""

    def __init__(
        self,
        hook: CounterfactualHook,
        publisher: CounterPublisher | None,
        rank_hidden: Callable[[Tensor, int], Tensor | DraftTopK],
        stop_of: Callable[[Any], frozenset[int]] | None = None,
    ) -> None:
        self.hook, self.publisher, self.rank_hidden = hook, publisher, rank_hidden
        self.stop_of = stop_of  # a request's stop tokens (the worker's: ddtree_info.stop_ids)
        self.round: RoundPlan | None = None

    def begin(self, batch: Any) -> None:
        self.round = self.hook.plan(batch.reqs, batch.req_pool_indices, self.stop_of)

    def models(self, models: Any, block: int) -> Any:
        """The tree round's models, teed on a sampled round."""
        plan = self.round
        if plan is None or not plan.sampled:
            return models
        return TeeDraftBlock(models, lambda out: self.hook.take_head(plan, out, block))

    def after_tree_round(self, bucket: Any) -> None:
        """The tree round returned; ``bucket``: the graph bucket whose plan stage it replayed (None: eager).
        On a sampled round, the bucket still holds this round's depth rows (the next round stages its own
        later, in stream order), so the head runs on them now, eagerly."""
        plan = self.round
        if plan is None or not plan.sampled or plan.top is not None or bucket is None:
            return
        self.hook.take_depth_logits(plan, bucket.depth_logits(plan.rows))

    def draft_out(self, out: Any, block: int) -> None:
        """The chain: DFlash's drafter pass over the block (``draft_model_runner.forward``); its hidden rows
        at depths 1..L, ranked on a sampled round. They are there whether DFlash's greedy head then runs
        eagerly or was folded into the draft graph (a replay hands back the graph's hidden-state buffer,
        which the next draft forward overwrites: ranked now, stream-ordered)."""
        plan = self.round
        if plan is None or not plan.sampled or plan.top is not None:
            return
        hidden = getattr(getattr(out, "logits_output", None), "hidden_states", None)
        if hidden is None:
            return  # nothing to rank: the round is fed, not scored
        rows = hidden[: plan.rows * block].view(plan.rows, block, -1)[:, 1:]
        self.hook.take_hidden(plan, rows.reshape(plan.rows * (block - 1), -1), self.rank_hidden)

    def end(self, result: Any) -> None:
        plan, self.round = self.round, None
        if plan is not None:
            self.hook.end(plan, result.next_token_ids, result.accept_lens)
        if self.publisher is not None:
            self.publisher.after_round()

    def flush(self) -> None:
        if self.publisher is not None:
            self.publisher.flush()


def build_scoring(worker: Any, *, model_name: str | None) -> WorkerScoring | None:
    """The worker's scoring from its settings, once its models and pools exist (first decode round); None
    when the fraction is 0 or nothing can be scored (the reason logged). ``model_name``: the counters'
    label, None when --enable-metrics is off (scored, not published); one rank per tensor-parallel group
    publishes (all score the same rounds)."""
    from sglang.srt.runtime_context import get_parallel

    from ddtree_runtime.sglang_plugin.round.draft_head import draft_head, lm_head_shard

    settings = worker.ddtree_settings
    scoring_settings = settings.counterfactual
    if scoring_settings is None or not scoring_settings.enabled:
        return None
    chain = settings.decoder.is_chain
    if chain and not chain_head_is_lm_heads_argmax(worker):
        logger.warning(
            "DDTREE counterfactual: not scored: this chain's drafts do not come from the LM head's argmax "
            "(a selector, LiLiCorr or Domino drafter, or a quantized head)"
        )
        return None
    horizon = settings.decoder.horizon
    runner = worker.target_worker.model_runner
    lm_head = runner.model.lm_head
    vocab = int(worker.model_runner.model_config.vocab_size)
    whole = lm_head_shard(lm_head, vocab).whole
    if not whole and getattr(get_parallel(), "attn_dp_enabled", False):
        # DP ranks decode different batches: a vocabulary-parallel head's top-K exchange on one rank's
        # sampled round would wait for ranks whose rounds are not the same.
        logger.warning("DDTREE counterfactual: not scored with DP attention and a vocabulary-parallel head")
        return None
    head_k = None
    if not chain and not whole:
        # The tree round's vocabulary-parallel head merges only the server's own K per depth.
        head_k = topk_width(settings.decoder.budget, vocab, settings.decoder.topk_cap)
    candidates = scoring_settings.candidates
    scored = head_candidates(candidates, head_k, vocab)
    if len(scored) < len(candidates):
        logger.warning(
            "DDTREE counterfactual: this server's vocabulary-parallel head ranks %d tokens per depth; "
            "candidates %s need more and are not scored (a narrower top-K would narrow their trees)",
            head_k, [c.label for c in candidates if c not in scored],
        )  # fmt: skip
    if not scored:
        return None
    hook = CounterfactualHook(
        scored,
        fraction=scoring_settings.fraction,
        horizon=horizon,
        num_slots=int(runner.req_to_token_pool.req_to_token.shape[0]),  # req_pool_idx's range
        device=worker.device,
    )

    warm_candidate_trees(hook.scorer, vocab)

    def rank_hidden(hidden: Tensor, k: int) -> Tensor | DraftTopK:
        # The group is read here, inside DFlash's draft_tp_context (as the tree round's head reads it).
        return draft_head(hidden, lm_head, vocab, get_parallel().tp_group, budget=k, topk_cap=None)

    publisher = None
    parallel = get_parallel()
    rank = int(getattr(parallel, "attn_tp_rank", getattr(parallel, "tp_rank", 0)) or 0)
    if model_name is not None and rank == 0:
        from ddtree_runtime.sglang_plugin.counterfactual_metrics import CounterfactualMetrics

        publisher = CounterPublisher(hook, CounterfactualMetrics(model_name).update)
    from ddtree_runtime.sglang_plugin.ddtree_info import stop_ids  # the round's own stop rule

    scoring = WorkerScoring(hook, publisher, rank_hidden, stop_ids)
    if chain:
        _tee_draft_forward(worker.draft_model_runner, lambda out: scoring.draft_out(out, horizon + 1))
    logger.info(
        "DDTREE counterfactual: scoring %s on %.3g of greedy decode rounds (%d slots)",
        ",".join(c.label for c in scored), scoring_settings.fraction, hook.scorer.num_slots,
    )  # fmt: skip
    return scoring


def warm_candidate_trees(scorer: CounterfactualScorer, vocab: int) -> None:
    """Build every candidate's tree once for one request from a made-up top-K: the tree kernels of
    budgets the server's own round never builds compile now, not on the first sampled round (their
    specialisations depend on the budget, not on the batch)."""
    k = min(scorer.max_budget, vocab)
    device, horizon = scorer.device, scorer.horizon
    ranks = torch.arange(k, device=device)
    log_probs = (-1.0 - ranks.float()).expand(1, horizon, k).contiguous()  # strictly descending: no ties
    ids = ranks.expand(1, horizon, k).contiguous()
    scorer.trees(DraftTopK(log_probs, ids, torch.zeros((1, horizon), device=device)))


def _tee_draft_forward(runner: Any, take: Callable[[Any], None]) -> None:
    """Wrap the drafter runner's ``forward`` (once) so that its block pass's output reaches ``take``."""
    forward = runner.forward

    def teed(forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        out = forward(forward_batch, *args, **kwargs)
        mode = getattr(forward_batch, "forward_mode", None)
        if mode is not None and mode.is_target_verify():  # DFlash's draft block (decode)
            take(out)
        return out

    teed.__wrapped__ = forward  # type: ignore[attr-defined]
    runner.forward = teed


def chain_head_is_lm_heads_argmax(worker: Any) -> bool:
    """DFlash's chain is the argmax of the target's dense LM head over the drafter's rows, except with a
    selector, LiLiCorr or Domino drafter (their own heads) or a quantized head."""
    if getattr(worker, "selector", None) is not None or getattr(worker, "lilicorr", None) is not None:
        return False
    if getattr(worker, "_is_domino", False):
        return False
    weight = getattr(worker.target_worker.model_runner.model.lm_head, "weight", None)
    return isinstance(weight, Tensor) and weight.dim() == 2 and weight.dtype.is_floating_point


IDLE = "sglang.srt.managers.scheduler.Scheduler.on_idle"


def flush_on_idle(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``Scheduler.on_idle``: no batch in flight, so the counters are read without waiting."""
    flush = getattr(getattr(scheduler, "draft_worker", None), "ddtree_counterfactual_flush", None)
    if callable(flush):
        flush()


def register_counterfactual_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(IDLE, flush_on_idle, HookType.AFTER)
