"""The tree round's own CUDA graphs: what runs between the drafter's forward and the target verify,
and (greedy rounds) between the verify and the drafter's context append, replayed per batch size.

DFLASH's round is two graph replays (drafter, verify) and a few fused launches. Between the same two
forwards a tree round issued dozens of eager launches from Python: the drafter's head, top-K, the
tree build, its verify arrays and mask, then the walk, the stop cut, the accepted rows, the KV move
and the drafter's context rows. On small models those launches were the round (8.8 against 5.6 ms at
one request on the H200, issue 40). Here they are two graphs per captured batch size:

* the plan graph: the drafter's depth rows through the target's LM head (fp32 logits), top-K, the
  best-first tree, its verify arrays, and the tree cells of the verify mask written in place into
  the target backend's own verify-mask buffer (``tree.write_tree_mask_cells``: the Triton verify
  reads only those cells), so the verify reads the mask where it would have copied it to;
* the accept graph (greedy): the walk from the target's choice at every row, the stop cut, the
  accepted rows as flat verify rows, their KV moved to the next logical rows (``move_kv_cache``),
  the new lengths, the drafter's context rows and positions, and what the scheduler reads
  (emitted tokens, their count, lengths, bonus) packed into one buffer the round clones once, since
  the next replay overwrites it while the scheduler's copy of this round may still be pending.

The graphs run the same functions the eager round runs (``tree_step.plan_tree_verify``,
``tree_round.accept_round``): a replay gives the eager round's answer bit for bit
(tests/gpu/test_round_graphs_gpu.py). Around each replay the round stages its inputs into the
bucket's static buffers (a few copies). A batch smaller than its bucket pads: the padded rows'
window slots are 0, SGLang's dummy slot, so their KV moves are 0 -> 0, and their mask cells land
after the real requests' and are never read. Every Triton kernel inside is compiled by the warm-up
before capture, at start-up, not under traffic.

Without CUDA (``capture=False``) a bucket runs the same functions eagerly on the same static
buffers, so the staging and the padding are tested on CPU (tests/sglang/test_round_graphs.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from ddtree_runtime.core.tree import DraftTree, VerifyInputs, WalkResult, walk_posterior
from ddtree_runtime.sglang_plugin.round.tree_commit import KVCommit
from ddtree_runtime.sglang_plugin.round.tree_round import (
    RoundAccept,
    RoundConfig,
    RoundInput,
    accept_round,
    stop_table_rows,
    truncate_at_stop_table,
)
from ddtree_runtime.sglang_plugin.round.tree_step import TreeAccept, TreeVerifyBatch, plan_tree_verify

logger = logging.getLogger(__name__)

# Stop sets per request the accept graph holds (EOS plus a few stop ids is the common case); a batch
# with a larger set runs its accept stage eagerly.
STOP_WIDTH = 8


@dataclass(frozen=True)
class GraphSpec:
    """What the round's graphs are built from (``round_graphs_for_worker`` reads it off SGLang)."""

    cfg: RoundConfig
    head: Callable[[Tensor], Tensor]  # the drafter's depth rows [N, H] -> fp32 logits [N, V]
    hidden_size: int
    hidden_dtype: torch.dtype
    kv_pool: Any  # the target's token-to-KV pool (move_kv_cache)
    mask_buffer: Tensor  # the target backend's verify-mask buffer
    mask_max_bs: int  # the most requests the buffer holds
    stop_width: int = STOP_WIDTH


class RoundBucket:
    """One batch size's static buffers and graphs (see module docstring)."""

    def __init__(self, size: int, spec: GraphSpec, device: torch.device) -> None:
        cfg = spec.cfg
        self.size = size
        self.spec = spec
        self.horizon = cfg.block_size - 1
        self.rows = cfg.verify_rows
        steps = self.horizon + 1
        zeros = {"device": device, "dtype": torch.long}
        self.depth_hidden = torch.zeros(
            (size, self.horizon, spec.hidden_size), dtype=spec.hidden_dtype, device=device
        )
        self.root = torch.zeros(size, **zeros)
        self.prefix = torch.zeros(size, **zeros)
        self.posterior = torch.zeros((size, self.rows), **zeros)
        self.slots = torch.zeros((size, cfg.write_window), **zeros)
        self.stop_table = torch.full((size, spec.stop_width), -2, **zeros)
        # What the scheduler reads, as contiguous segments (SGLang's kernels read some with stride
        # 1): emitted tokens [size, L+1], then their count, the new length, the bonus and the
        # accepted draft tokens, [size] each.
        self.pack = torch.zeros(size * (steps + 4), **zeros)
        self._stops_key: tuple[frozenset[int], ...] | None = None
        self._plan_out: TreeVerifyBatch | None = None
        self._accept_out: RoundAccept | None = None
        self._plan_graph: Any = None
        self._accept_graph: Any = None

    # --- the two stages, as the graphs hold them --------------------------------------------
    def _head_logits(self) -> Tensor:
        n = self.size
        return self.spec.head(self.depth_hidden.reshape(n * self.horizon, -1)).view(n, self.horizon, -1)

    def _plan(self) -> TreeVerifyBatch:
        cfg = self.spec.cfg
        return plan_tree_verify(
            self._head_logits(),
            self.root,
            self.prefix,
            cfg.budget,
            topk_cap=cfg.topk_cap,
            mask_buffer=self.spec.mask_buffer,
            depth_first=cfg.depth_first,
        )

    def _accept(self) -> RoundAccept:
        assert self._plan_out is not None, "the accept stage reads the plan stage's tree"
        walk = walk_posterior(self._plan_out.tree, self.posterior)
        walk, finished = truncate_at_stop_table(walk, self.stop_table)
        done = accept_round(
            walk,
            finished,
            rows=self.rows,
            slots=self.slots,
            prefix=self.prefix,
            kv_pool=self.spec.kv_pool,
            page_size=self.spec.cfg.page_size,
        )
        steps = walk.accepted.shape[1]
        context_rows = done.accept.accept_index.clamp(min=0)
        positions = self.prefix.unsqueeze(1) + torch.arange(steps, device=self.prefix.device)
        segments = [walk.num_emitted, done.kv.new_seq_lens, walk.bonus, done.accept.accept_length]
        self.pack.copy_(torch.cat([walk.emitted.reshape(-1), *segments]))
        return replace(done, context_rows=context_rows, context_positions=positions)

    # --- capture ---------------------------------------------------------------------------
    def warm(self) -> None:
        """Run both stages eagerly (compiles every Triton kernel they launch)."""
        self._plan_out = self._plan()
        self._accept_out = self._accept()

    def capture(self, pool: Any, stream: Any) -> None:
        plan_graph, accept_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(plan_graph, pool=pool, stream=stream):
            self._plan_out = self._plan()
        with torch.cuda.graph(accept_graph, pool=pool, stream=stream):
            self._accept_out = self._accept()
        self._plan_graph, self._accept_graph = plan_graph, accept_graph

    def replay_stages(self) -> None:
        """Both stages on whatever the static buffers hold, as a round replays them (graphs, else eager):
        what the start-up price table times (``price_stages``). At start-up the buffers hold zeros, so the
        accept stage's KV moves are 0 -> 0 (SGLang's dummy slot)."""
        if self._plan_graph is not None and self._accept_graph is not None:
            self._plan_graph.replay()
            self._accept_graph.replay()
        else:
            self._plan_out = self._plan()
            self._accept_out = self._accept()

    # --- one round ---------------------------------------------------------------------------
    def plan(
        self, depth_hidden: Tensor, root: Tensor, prefix: Tensor, mask_cells: int | None
    ) -> TreeVerifyBatch:
        """Stage the drafter's depth rows ``[b, L, H]``, the roots and prefix lengths ``[b]``; replay
        the plan stage; its outputs as the batch's ``TreeVerifyBatch`` (views of the bucket's)."""
        b = depth_hidden.shape[0]
        self.depth_hidden[:b].copy_(depth_hidden)
        self.root[:b].copy_(root)
        self.prefix[:b].copy_(prefix)
        if self._plan_graph is not None:
            self._plan_graph.replay()
        else:
            self._plan_out = self._plan()
        assert self._plan_out is not None
        return _plan_view(self._plan_out, b, self.spec.mask_buffer, mask_cells)

    def depth_logits(self, b: int) -> Tensor:
        """The last plan stage's per-depth draft logits ``[b, L, V]``, recomputed eagerly from the depth rows
        it staged (the graph keeps them; the logits it computed are not kept): the same head on the same
        shape, so the same values. For counterfactual scoring on sampled rounds (``counterfactual_hook``);
        valid until the next round stages its rows (stream order)."""
        return self._head_logits()[:b]

    def accept(
        self, posterior: Tensor, slots: Tensor, stops: tuple[frozenset[int], ...] | None
    ) -> RoundAccept | None:
        """Greedy: the target's choice at every verify row ``[b * (B+1)]`` and the window's slots
        ``[b, W]``; replay the accept stage. None when the stop sets do not fit the graph's table
        (the round then runs the stage eagerly)."""
        b = slots.shape[0]
        if not self._stage_stops(tuple(stops or ()), b):
            return None
        self.posterior[:b].copy_(posterior.view(b, self.rows))
        self.slots[:b].copy_(slots)
        if b < self.size:
            self.slots[b:].zero_()  # padded rows: 0 -> 0 moves into SGLang's dummy slot
        if self._accept_graph is not None:
            self._accept_graph.replay()
        else:
            self._accept_out = self._accept()
        assert self._accept_out is not None
        return _accept_view(self._accept_out, self.pack.clone(), b, self.size)

    def _stage_stops(self, stops: tuple[frozenset[int], ...], b: int) -> bool:
        if stops == self._stops_key:
            return True
        if any(len(s) > self.spec.stop_width for s in stops) or len(stops) > self.size:
            return False
        host = stop_table_rows(stops, self.size, self.spec.stop_width)
        if self.stop_table.is_cuda:
            host = host.pin_memory()  # a pageable copy would wait for the device
        self.stop_table.copy_(host, non_blocking=True)
        self._stops_key = stops
        return True


def _plan_view(out: TreeVerifyBatch, b: int, mask_buffer: Tensor, mask_cells: int | None) -> TreeVerifyBatch:
    t, i, rows = out.tree, out.inputs, out.draft_token_num
    tree = DraftTree(
        tokens=t.tokens[:b], depths=t.depths[:b], parents=t.parents[:b], scores=t.scores[:b],
        num_nodes=t.num_nodes[:b], horizon=t.horizon,
    )  # fmt: skip
    inputs = VerifyInputs(
        input_ids=i.input_ids[:b], positions=i.positions[:b], visibility=i.visibility[:b],
        retrieve_index=i.retrieve_index[:b], retrieve_next_token=i.retrieve_next_token[:b],
        retrieve_next_sibling=i.retrieve_next_sibling[:b],
    )  # fmt: skip
    return TreeVerifyBatch(
        tree=tree,
        inputs=inputs,
        candidates=out.candidates[:b],
        draft_token=out.draft_token[: b * rows],
        positions=out.positions[: b * rows],
        custom_mask=mask_buffer if mask_cells is None else mask_buffer[:mask_cells],
        retrieve_index=out.retrieve_index[:b],
        retrieve_next_token=out.retrieve_next_token[:b],
        retrieve_next_sibling=out.retrieve_next_sibling[:b],
    )


def _accept_view(out: RoundAccept, pack: Tensor, b: int, size: int) -> RoundAccept:
    """The batch's rows of the accept stage; what outlives the round (tokens, counts, lengths,
    bonus) from ``pack``, the round's own copy of the bucket's segments (each contiguous)."""
    steps = out.walk.accepted.shape[1]
    tail = size * steps
    emitted = pack[:tail].view(size, steps)[:b]
    num, new_len, bonus, accepted_tokens = (pack[tail + k * size : tail + k * size + b] for k in range(4))
    walk = WalkResult(
        accepted=out.walk.accepted[:b], num_accepted=num, bonus=bonus, emitted=emitted,
        num_emitted=num, tree_rows=out.walk.tree_rows,
    )  # fmt: skip
    accept = TreeAccept(
        walk=walk, accept_index=out.accept.accept_index[:b], accept_length=accepted_tokens, bonus=bonus
    )
    kv = KVCommit(
        new_seq_lens=new_len,
        committed_slots=out.kv.committed_slots[:b],
        window_slots=out.kv.window_slots[:b],
        released=out.kv.released,
        moved_rows=out.kv.moved_rows,
    )
    assert out.context_rows is not None and out.context_positions is not None
    return RoundAccept(
        walk=walk,
        finished=out.finished[:b],
        accept=accept,
        kv=kv,
        context_rows=out.context_rows[:b],
        context_positions=out.context_positions[:b],
    )


class RoundGraphs:
    """The round's buckets by batch size (``run_tree_round(..., graphs=...)``)."""

    def __init__(self, spec: GraphSpec, device: torch.device, *, capture: bool = True) -> None:
        self.spec = spec
        self.device = device
        self.capture = capture
        self.buckets: dict[int, RoundBucket] = {}
        self.seconds = 0.0

    def build(self, batch_sizes: Iterable[int]) -> list[int]:
        """Warm and capture a bucket per batch size the verify-mask buffer holds, largest first
        (smaller buckets then reuse the graph pool's blocks). Returns the sizes built."""
        started = time.monotonic()
        sizes = sorted({int(s) for s in batch_sizes if 0 < int(s) <= self.spec.mask_max_bs}, reverse=True)
        pool = stream = None
        if self.capture:
            pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
        for size in sizes:
            bucket = RoundBucket(size, self.spec, self.device)
            if self.capture:
                with torch.cuda.stream(stream):
                    bucket.warm()
                    bucket.warm()  # twice, as SGLang warms a shape before it captures it
                bucket.capture(pool, stream)
            self.buckets[size] = bucket
        if self.capture:
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
        self.seconds = time.monotonic() - started
        return sorted(self.buckets)

    def plan_stage(self, b: int, inp: RoundInput) -> RoundBucket | None:
        """The smallest bucket that holds ``b`` requests, or None (the round runs eagerly)."""
        fits = [size for size in self.buckets if size >= b]
        return self.buckets[min(fits)] if fits else None


def warm_eager_moves(kv_pool: Any, steps: int, max_bs: int, device: torch.device) -> None:
    """Compile SGLang's ``move_kv_cache`` for every batch a sampled (T > 0) round moves eagerly:
    ``b * (L + 1)`` entries specialise it (a power-of-two bucket), so a first sampled round at a new
    batch size would compile under traffic. 0 -> 0 moves: SGLang's dummy slot, no data changes."""
    for b in range(1, max_bs + 1):
        zeros = torch.zeros(b * steps, dtype=torch.long, device=device)
        kv_pool.move_kv_cache(zeros, zeros)


# Set to 0 to run every tree round eagerly (the round as it was before its graphs).
ENV_SWITCH = "SGLANG_DDTREE_ROUND_GRAPHS"


def round_graphs_for_worker(worker: Any, cfg: RoundConfig) -> RoundGraphs | None:
    """The round's graphs for a ``DDTreeWorker`` whose target captured its verify graphs, built
    and captured now; None (every round eager, with the reason logged) where they cannot hold the
    round: no CUDA, no captured verify graphs, a vocabulary-parallel head (its top-K exchange is a
    collective), or a verify mask the Triton backend does not read in place."""
    import os

    from ddtree_runtime.sglang_plugin.round.draft_head import draft_head, lm_head_shard

    def eager(reason: str) -> None:
        logger.info("DDTREE: tree rounds run eagerly: %s", reason)

    if os.environ.get(ENV_SWITCH, "1") == "0":
        return eager(f"{ENV_SWITCH}=0")
    runner = worker.target_worker.model_runner
    graph_runner = getattr(runner, "decode_cuda_graph_runner", None)
    sizes = list(getattr(graph_runner, "capture_bs", None) or [])
    if not torch.cuda.is_available() or not sizes:
        return eager("the target captured no verify graphs")
    lm_head = runner.model.lm_head
    vocab = int(worker.model_runner.model_config.vocab_size)
    if not lm_head_shard(lm_head, vocab).whole:
        return eager("the drafter's head is vocabulary-parallel (its top-K exchange is a collective)")
    mask = getattr(runner.attn_backend, "verify_mask", None)
    if mask is None or getattr(mask.mode, "name", "") != "FULL_MASK":
        return eager("the target's attention backend keeps no full verify-mask buffer")

    def head(rows: Tensor) -> Tensor:
        return draft_head(rows, lm_head, vocab, None, budget=cfg.budget, topk_cap=cfg.topk_cap)

    spec = GraphSpec(
        cfg=cfg,
        head=head,
        hidden_size=int(worker.draft_model.config.hidden_size),
        hidden_dtype=getattr(worker.draft_model_runner, "dtype", None) or torch.bfloat16,
        kv_pool=runner.token_to_kv_pool,
        mask_buffer=mask.buffer,
        mask_max_bs=int(mask.max_bs),
    )
    graphs = RoundGraphs(spec, mask.buffer.device)
    built = graphs.build(sizes)
    warm_eager_moves(runner.token_to_kv_pool, cfg.block_size, max(built, default=0), mask.buffer.device)
    logger.info("DDTREE: tree-round graphs captured for batch sizes %s in %.1f s", built, graphs.seconds)
    return graphs
