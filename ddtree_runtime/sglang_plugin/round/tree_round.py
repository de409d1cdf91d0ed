"""One DDTREE decode round over SGLang's pools, with the two model passes injected.

The round (ddtree-algorithm.md section 3) is the same whatever runs the models:

1. the drafter's block ``[bonus, MASK x L]`` at positions ``prefix ..`` -> per-depth logits
   (or, under tensor parallelism, their merged top-K and logsumexp: ``tp_head``);
2. ``ddtree_runtime.core.tree`` builds the tree (CUDA kernels on GPU) and the verify arrays:
   tokens, positions ``prefix + depth``, the ancestor mask (``tree_step.plan_tree_verify``);
3. ONE target forward over ``budget + 1`` rows per request, written at logical positions
   ``prefix .. prefix + budget``; the hidden states are checked (None, rank, width, rows)
   right after it;
4. the walk: greedy, or lossless sampling at T > 0 (``walk_sample``: a genuine target sample at
   every node, never min(1, p/q));
5. stop tokens truncate the emitted tokens (and with them the committed rows); on a hybrid
   target the accepted node's recurrent state is committed now (``commit_state``), before any
   other target forward;
6. the accepted rows' KV move to the next logical rows' slots (``tree_commit``; ``req_to_token``
   is never written), and the new lengths are published (``on_lengths``);
7. the drafter gets the target hidden states of the accepted rows gathered by NODE INDEX (never
   a contiguous prefix of the verify rows), appended to its KV at consecutive positions.

Every step has shapes fixed by (batch, budget, block) and reads nothing back to the host, so the
round meets SGLang's overlap contract (the scheduler prepares round n+1 while round n runs).

``RoundModels`` is the seam: the worker implements it with SGLang's model runners on GPU; tests
implement it with a toy model on CPU. Pools, tree, walk, commit and gather are the real code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from ddtree_runtime.core.contract import HiddenContract
from ddtree_runtime.core.decoder_settings import DecoderSettings
from ddtree_runtime.core.hidden_states import check_hidden_states
from ddtree_runtime.core.model_files import ContractError
from ddtree_runtime.core.tree import DraftTopK, WalkResult, walk_greedy, walk_sample
from ddtree_runtime.sglang_plugin.round.tree_commit import KVCommit, commit_accepted_kv, window_slots
from ddtree_runtime.sglang_plugin.round.tree_step import (
    TreeAccept,
    TreeVerifyBatch,
    draft_position_logits,
    plan_tree_verify,
)


class RoundModels(Protocol):
    def draft_block(
        self, block_ids: Tensor, positions: Tensor, cache_loc: Tensor, req_pool_indices: Tensor
    ) -> Tensor | DraftTopK:
        """Drafter over ``block_ids [b, block]`` (its context: the draft KV of each request's
        ``req_to_token`` row) -> logits ``[b * block, V]`` over the global vocabulary (slot 0, the
        bonus, is not read), or, from a vocabulary-parallel head, the per-depth top-K and
        logsumexp ``DraftTopK [b, block - 1, K]`` merged over the TP group (``tp_head``)."""

    def draft_hidden(
        self, block_ids: Tensor, positions: Tensor, cache_loc: Tensor, req_pool_indices: Tensor
    ) -> Tensor:
        """:meth:`draft_block` without the head: the drafter's hidden rows of depths 1..L
        ``[b, L, H]``, for the round's CUDA graphs, which hold the head (``round_graphs``). Only
        called when the round has graphs."""

    def target_verify(
        self, plan: TreeVerifyBatch, cache_loc: Tensor, req_pool_indices: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        """Target over the tree rows (tokens, positions, mask in ``plan``; KV written at
        ``cache_loc [b * (B+1)]``) -> (logits ``[b * (B+1), V]``, hidden ``[b * (B+1), W]``)."""

    def append_draft_context(
        self, hidden: Tensor, cache_loc_2d: Tensor, positions: Tensor, commit_lens: Tensor
    ) -> None:
        """Project ``hidden [b * S, W]`` into the drafter's KV at ``cache_loc_2d [b, S]``,
        ``positions [b * S]`` (row-major), writing only request r's first ``commit_lens[r]`` rows
        (DFlash's prefix-valid writer: fixed shapes, no variable-length selection)."""


@dataclass(frozen=True)
class RoundConfig:
    budget: int
    block_size: int
    mask_token_id: int
    page_size: int = 1
    topk_cap: int | None = None
    window: int | None = None  # rows written per round; default max(budget + 1, block_size)
    # Verify rows depth first (each first child right after its parent) instead of the heap order: what
    # lets a GDN verify keep the parent's state in registers (gdn_verify_kernel). Same tokens either way.
    depth_first: bool = False

    @classmethod
    def from_settings(
        cls, settings: DecoderSettings, *, mask_token_id: int, page_size: int = 1, depth_first: bool = False
    ) -> RoundConfig:
        """The round's configuration from the decoder's settings (``core/decoder_settings.py``): the one
        place the worker builds it."""
        return cls(settings.budget, settings.block_size, mask_token_id, page_size, settings.topk_cap,
                   settings.kv_window, depth_first)  # fmt: skip

    @property
    def verify_rows(self) -> int:
        return self.budget + 1

    @property
    def write_window(self) -> int:
        return self.window or max(self.verify_rows, self.block_size)


@dataclass(frozen=True)
class RoundInput:
    req_pool_indices: Tensor  # [b]
    prefix_lens: Tensor  # [b] committed length = target KV length
    bonus_tokens: Tensor  # [b] last target-chosen token, not yet in KV (this round's root)
    temperatures: Tensor | None = None  # [b]; None or all 0 = greedy
    top_ks: Tensor | None = None  # [b] (T > 0 rows only)
    top_ps: Tensor | None = None  # [b]
    stop_token_ids: tuple[frozenset[int], ...] | None = None  # per request
    # Host-side bound of the flat verify mask (reserved lengths): the mask is then written at
    # device-computed offsets and the round reads nothing back (tree_step.plan_tree_verify).
    mask_cells: int | None = None


@dataclass(frozen=True)
class RoundOutput:
    out_tokens: Tensor  # [b, L+1] emitted tokens (accepted + bonus), -1 padded, stop-truncated
    commit_lens: Tensor  # [b] emitted tokens = committed KV rows
    new_seq_lens: Tensor  # [b]
    bonus_tokens: Tensor  # [b] next round's root
    accept_length: Tensor  # [b] accepted draft tokens (commit_lens - 1)
    finished: Tensor  # [b] bool, a stop token was emitted
    plan: TreeVerifyBatch
    accept: TreeAccept
    kv: KVCommit
    draft_context_rows: Tensor  # [b, L+1] flat verify rows the drafter got (first commit_lens rows)
    # The graph bucket whose plan stage ran this round (round_graphs.RoundBucket), None when eager: what
    # counterfactual scoring reads the round's draft logits from (counterfactual_hook).
    graph_bucket: Any = None


def check_verify_hidden(hidden: Tensor | None, rows: int, contract: HiddenContract | None) -> None:
    """After every target verify: hidden states present, 2-D, one row per tree node, and the
    drafter's width (the contract's numbers when known)."""
    if contract is not None:
        check_hidden_states(hidden, contract, num_tokens=rows)
        return
    if hidden is None:
        raise ContractError("hidden_states_missing", "the target verify returned no hidden states")
    if hidden.dim() != 2 or hidden.shape[0] != rows:
        raise ContractError(
            "hidden_width_mismatch",
            f"the target verify returned hidden states {tuple(hidden.shape)}; expected [{rows}, W] "
            "(one row per tree node)",
            expected_rows=rows,
            observed=tuple(hidden.shape),
        )


def processed_probs(
    logits: Tensor, temperatures: Tensor, top_ks: Tensor | None = None, top_ps: Tensor | None = None
) -> Tensor:
    """The target's sampling law per row: softmax(logits / T), then top-k and top-p (the request's
    own settings, applied to the target before the walk samples it). ``logits [b, rows, V]``,
    per-request ``temperatures / top_ks / top_ps [b]``; top-k <= 0 or >= V and top-p >= 1 keep all."""
    b, _, vocab = logits.shape
    temps = temperatures.to(logits.device).float().reshape(b, 1, 1).clamp(min=1e-6)
    probs = torch.softmax(logits.float() / temps, dim=-1)
    if top_ks is None and top_ps is None:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    ranks = torch.arange(vocab, device=logits.device)
    if top_ks is not None:
        k = top_ks.to(logits.device).long().reshape(b, 1, 1)
        k = torch.where((k <= 0) | (k >= vocab), torch.full_like(k, vocab), k)
        keep &= ranks < k
    if top_ps is not None:
        p = top_ps.to(logits.device).float().reshape(b, 1, 1)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the tokens ranked above
        keep &= (before < p) | (ranks == 0)
    sorted_p = torch.where(keep, sorted_p, 0.0)
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs / probs.sum(dim=-1, keepdim=True)


def walk_round(
    plan: TreeVerifyBatch,
    target_logits: Tensor,
    temperatures: Tensor | None,
    *,
    top_ks: Tensor | None = None,
    top_ps: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> WalkResult:
    """Greedy when ``temperatures`` is None (the caller's host flag: SGLang's
    ``sampling_info.is_all_greedy``; deciding it from the tensor would read the device); otherwise
    the lossless sampling walk (``walk_sample``: the target's processed distribution sampled at
    each visited node; rows with T = 0 take the argmax)."""
    b, rows = plan.candidates.shape
    logits = target_logits.reshape(b, rows, -1)
    if temperatures is None:
        return walk_greedy(plan.tree, logits)
    temps = temperatures.to(logits.device).float()
    probs = processed_probs(logits, temps, top_ks, top_ps)
    # T = 0 rows: a one-hot at the argmax, so the same sampling walk decides them greedily.
    greedy = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(probs.dtype)
    probs = torch.where(temps.reshape(b, 1, 1) > 0, probs, greedy)
    return walk_sample(plan.tree, probs, generator=generator)


def truncate_at_stop(
    walk: WalkResult, stop_token_ids: tuple[frozenset[int], ...] | None
) -> tuple[WalkResult, Tensor]:
    """Cut each request's emitted tokens after its first stop token; the committed rows shrink
    with them (row k is the node whose output is emitted token k). On the device, with no host
    read: every request has a stop set (EOS at least), and reading each request's tokens back cost
    one device sync per request per round."""
    b = walk.emitted.shape[0]
    if not stop_token_ids or not any(stop_token_ids):
        return walk, torch.zeros(b, dtype=torch.bool, device=walk.emitted.device)
    return truncate_at_stop_table(walk, _stop_table(tuple(stop_token_ids), walk.emitted.device))


def truncate_at_stop_table(walk: WalkResult, table: Tensor) -> tuple[WalkResult, Tensor]:
    """:func:`truncate_at_stop` with the batch's stop sets as a device table ``[b, S]`` (-2 where a
    request has fewer than S stops): fixed shapes, so a CUDA graph can hold it (``round_graphs``)."""
    b, width = walk.emitted.shape
    device = walk.emitted.device
    steps = torch.arange(width, device=device).expand(b, -1)
    live = steps < walk.num_emitted.unsqueeze(1)
    hit = (walk.emitted.unsqueeze(-1) == table.unsqueeze(1)).any(-1) & live
    finished = hit.any(dim=1)
    first = hit.to(torch.int8).argmax(dim=1)  # the first True (argmax returns the first maximum)
    num = torch.where(finished, first + 1, walk.num_emitted)
    live = steps < num.unsqueeze(1)
    emitted = torch.where(live, walk.emitted, -1)
    last = emitted.gather(1, (num - 1).unsqueeze(1)).squeeze(1)
    cut = WalkResult(
        accepted=torch.where(live, walk.accepted, -1),
        num_accepted=num,
        bonus=last,
        emitted=emitted,
        num_emitted=num.clone(),
        tree_rows=walk.tree_rows,
    )
    return cut, finished


def stop_table_rows(stops: tuple[frozenset[int], ...], rows: int, width: int) -> Tensor:
    """The host table :func:`truncate_at_stop_table` reads: ``[rows, width]`` int64, -2 padded
    (requests past ``len(stops)`` stop on nothing)."""
    host = torch.full((rows, width), -2, dtype=torch.long)
    for r, ids in enumerate(stops):
        if ids:
            host[r, : len(ids)] = torch.tensor(sorted(ids), dtype=torch.long)
    return host


_stop_tables: dict[tuple[tuple[frozenset[int], ...], str], Tensor] = {}


def _stop_table(stops: tuple[frozenset[int], ...], device: torch.device) -> Tensor:
    """The batch's stop sets as a device tensor, kept while the batch's stop sets stay the same (they
    change only when requests join or leave), so a round copies nothing to the device for them."""
    key = (stops, str(device))
    table = _stop_tables.get(key)
    if table is None:
        host = stop_table_rows(stops, len(stops), max(1, max(len(s) for s in stops)))
        if device.type == "cuda":
            host = host.pin_memory()  # a pageable copy would wait for the device
        table = host.to(device, non_blocking=True)
        _stop_tables.clear()  # one batch composition at a time
        _stop_tables[key] = table
    return table


@dataclass(frozen=True)
class RoundAccept:
    """What the walk decided and where its KV went: the part of a round after the verify that a
    CUDA graph can hold (``round_graphs``), or that runs eagerly (``accept_round``)."""

    walk: WalkResult  # stop-cut
    finished: Tensor  # [b] bool
    accept: TreeAccept
    kv: KVCommit
    # The drafter's context rows (flat verify rows, padding clamped) and positions [b, L+1], when
    # a graph computed them already; else the round computes them.
    context_rows: Tensor | None = None
    context_positions: Tensor | None = None


def accept_round(
    walk: WalkResult,
    finished: Tensor,
    *,
    rows: int,
    slots: Tensor,
    prefix: Tensor,
    kv_pool: Any,
    page_size: int,
    req_to_token: Tensor | None = None,
    req_pool_indices: Tensor | None = None,
    release: Callable[[Tensor], None] | None = None,
) -> RoundAccept:
    """After the walk and the stop cut: the accepted rows as flat verify rows, and their KV moved to
    the next logical rows (``tree_commit``)."""
    b = walk.accepted.shape[0]
    base = (torch.arange(b, device=walk.accepted.device) * rows).unsqueeze(1)
    accept_index = torch.where(walk.accepted >= 0, walk.accepted + base, -1)
    accept = TreeAccept(
        walk=walk, accept_index=accept_index, accept_length=walk.num_accepted - 1, bonus=walk.bonus
    )
    kv = commit_accepted_kv(
        walk,
        slots=slots,
        prefix_lens=prefix,
        kv_pool=kv_pool,
        page_size=page_size,
        req_to_token=req_to_token,
        req_pool_indices=req_pool_indices,
        release=release,
    )
    return RoundAccept(walk=walk, finished=finished, accept=accept, kv=kv)


def draft_block_inputs(
    bonus_tokens: Tensor, prefix: Tensor, block: int, mask_token_id: int
) -> tuple[Tensor, Tensor]:
    """The drafter's block ``[bonus, MASK x L]`` ``[b, block]`` and its positions ``prefix ..``."""
    b = prefix.shape[0]
    block_ids = torch.full((b, block), mask_token_id, dtype=torch.long, device=prefix.device)
    block_ids[:, 0] = bonus_tokens.to(prefix.device)
    return block_ids, prefix.unsqueeze(1) + torch.arange(block, device=prefix.device)


class RoundGraphsLike(Protocol):
    """What ``run_tree_round`` asks of the round's CUDA graphs (``round_graphs.RoundGraphs``)."""

    def plan_stage(self, b: int, inp: RoundInput) -> Any:
        """The bucket that replays this round's plan (and, greedy, its accept) stages, or None."""


def run_tree_round(
    models: RoundModels,
    inp: RoundInput,
    cfg: RoundConfig,
    *,
    req_to_token: Tensor,
    kv_pool: Any,
    contract: HiddenContract | None = None,
    release: Callable[[Tensor], None] | None = None,
    generator: torch.Generator | None = None,
    on_hidden: Callable[[Tensor | None], None] | None = None,
    commit_state: Callable[[Tensor, Tensor], None] | None = None,
    on_lengths: Callable[[Tensor], None] | None = None,
    graphs: RoundGraphsLike | None = None,
) -> RoundOutput:
    """One decode round for a batch (see module docstring). ``release``: see ``tree_commit``.
    ``commit_state(accept_index [b, L+1], commit_lens [b])``: hybrid targets' recurrent-state
    commit of the accepted rows (flat verify rows, -1 padded), called after the walk, the stop cut
    and the KV move, before the lengths are published and before any other target forward.
    ``on_lengths(new_seq_lens)``: called as soon as the lengths are final, before the drafter's
    context append (SGLang's ``on_publish``, which lets the overlap scheduler go on).
    ``graphs``: the round's CUDA graphs (``round_graphs``); where one covers this batch, the stages
    between the drafter's forward and the verify (head, tree, verify arrays, mask) and, greedy,
    between the verify and the drafter's context (walk, stop cut, accept rows, KV move, lengths)
    are graph replays with the same kernels; otherwise they run eagerly.

    With ``inp.mask_cells`` set (and no ``release``) nothing in the round reads the device: every
    shape is fixed by the batch, the budget and the block (tests/sglang/test_tree_round_sync.py)."""
    device = req_to_token.device
    idx = inp.req_pool_indices.long().to(device)
    prefix = inp.prefix_lens.long().to(device)
    b = idx.shape[0]
    block = cfg.block_size
    rows = cfg.verify_rows
    # The window's slots, read once and before the verify: afterwards the scheduler may hand a
    # finished request's req_to_token row to another request (tree_commit).
    slots = window_slots(req_to_token, idx, prefix, cfg.write_window)
    staged = graphs.plan_stage(b, inp) if graphs is not None and release is None else None

    # 1) drafter block: [bonus, MASK x L] at prefix .. prefix + block - 1
    # 2) tree + verify arrays
    block_ids, block_pos = draft_block_inputs(inp.bonus_tokens, prefix, block, cfg.mask_token_id)
    if staged is not None:
        depth_hidden = models.draft_hidden(block_ids, block_pos, slots[:, :block].reshape(-1), idx)
        plan = staged.plan(depth_hidden, block_ids[:, 0], prefix, inp.mask_cells)
    else:
        draft_logits = models.draft_block(block_ids, block_pos, slots[:, :block].reshape(-1), idx)
        plan = plan_tree_verify(
            draft_position_logits(draft_logits, b),
            block_ids[:, 0],
            prefix,
            cfg.budget,
            topk_cap=cfg.topk_cap,
            mask_cells=inp.mask_cells,
            depth_first=cfg.depth_first,
        )

    # 3) target verify + hidden guard
    target_logits, hidden = models.target_verify(plan, slots[:, :rows].reshape(-1), idx)
    if on_hidden is not None:
        on_hidden(hidden)
    check_verify_hidden(hidden, b * rows, contract)

    # 4-6) walk, stop tokens, accepted rows, KV commit
    done = None
    if staged is not None and inp.temperatures is None:
        done = staged.accept(target_logits.argmax(dim=-1), slots, inp.stop_token_ids)
    if done is None:
        walk = walk_round(
            plan, target_logits, inp.temperatures, top_ks=inp.top_ks, top_ps=inp.top_ps, generator=generator
        )
        walk, finished = truncate_at_stop(walk, inp.stop_token_ids)
        done = accept_round(
            walk,
            finished,
            rows=rows,
            slots=slots,
            prefix=prefix,
            kv_pool=kv_pool,
            page_size=cfg.page_size,
            req_to_token=req_to_token,
            req_pool_indices=idx,
            release=release,
        )
    walk, accept, kv = done.walk, done.accept, done.kv
    if commit_state is not None:
        commit_state(accept.accept_index, walk.num_emitted)
    if on_lengths is not None:
        on_lengths(kv.new_seq_lens)

    # 7) drafter context: accepted rows by node index (padding clamped to a real row and not
    # written: the prefix-valid writer stops at commit_lens), at consecutive positions
    context_rows = done.context_rows
    if context_rows is None:
        context_rows = accept.accept_index.clamp(min=0)
    positions = done.context_positions
    if positions is None:
        positions = prefix.unsqueeze(1) + torch.arange(walk.accepted.shape[1], device=device)
    assert hidden is not None  # checked above
    context = hidden.index_select(0, context_rows.reshape(-1))
    models.append_draft_context(context, kv.window_slots, positions.reshape(-1), walk.num_emitted)

    return RoundOutput(
        out_tokens=walk.emitted,
        commit_lens=walk.num_emitted,
        new_seq_lens=kv.new_seq_lens,
        bonus_tokens=walk.bonus,
        accept_length=walk.num_accepted - 1,
        finished=done.finished,
        plan=plan,
        accept=accept,
        kv=kv,
        draft_context_rows=context_rows,
        graph_bucket=staged,
    )
