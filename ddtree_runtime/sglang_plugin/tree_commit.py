"""Commit a tree round's accepted KV into SGLang's pools (``ReqToTokenPool`` + token-to-KV pool).

The verify forward wrote node ``i`` of request ``r`` at logical position ``prefix_r + i``
(``req_to_token[r, prefix_r + i]``). After the walk the accepted nodes (root first, strictly
increasing node indices) must sit at logical positions ``prefix_r .. prefix_r + a - 1``:

* page size 1: no data moves. The request's window ``req_to_token[r, prefix : prefix + W]`` is
  permuted so the accepted slots come first, in path order; the rejected slots follow;
* page size > 1: a slot's page is fixed by its logical position, so the accepted rows' K/V are
  moved (``move_kv_cache``, every layer) from ``prefix + node`` to ``prefix + k``; ``k <= node``,
  so an in-order move never reads a row it already overwrote (SGLang's move gathers first anyway).

Where the rejected slots go depends on who owns them:

* SGLang spec-v2 (``DFlashWorkerV2`` and this plugin's worker): the scheduler reserves the verify
  window ahead of time (``DFlashDraftInputV2.prepare_for_decode``, ``alloc_for_spec_decode``) and
  frees the request's whole allocation when it finishes. Rejected slots stay in that reservation,
  past the committed length, and the next round overwrites them. Freeing them here would free
  them twice. ``release=None``.
* a caller that allocated the verify window for this round only (SGLang spec-v1 style): pass
  ``release=allocator.free``; the slots (page 1) or whole pages (page > 1) past the committed
  length are handed back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ddtree_runtime.core.tree import WalkResult, commit_plan


@dataclass(frozen=True)
class KVCommit:
    new_seq_lens: Tensor  # [b] prefix + committed rows
    committed_slots: Tensor  # [b, L+1] physical slot of committed logical row prefix + k, -1 padded
    released: Tensor  # flat slots handed to ``release`` (empty without one)
    moved_rows: int  # K/V rows copied (page size > 1; 0 for page size 1)


def _window_cols(prefix_lens: Tensor, width: int) -> Tensor:
    return prefix_lens.long().unsqueeze(1) + torch.arange(width, device=prefix_lens.device)


def accepted_first_order(accepted: Tensor, window: int) -> Tensor:
    """``[b, window]`` permutation of a request's window rows: accepted nodes first in path order,
    then every other row in its old order (no row lost, none doubled)."""
    b, steps = accepted.shape
    device = accepted.device
    valid = accepted >= 0
    rank = torch.full((b, window + 1), window, dtype=torch.long, device=device)
    step_ids = torch.arange(steps, device=device).expand(b, steps)
    rank.scatter_(1, torch.where(valid, accepted, window), torch.where(valid, step_ids, window))
    key = rank[:, :window] * (window + 1) + torch.arange(window, device=device)
    return torch.argsort(key, dim=1)


def commit_accepted_kv(
    walk: WalkResult,
    *,
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    prefix_lens: Tensor,
    kv_pool: Any,
    page_size: int,
    window: int,
    release: Callable[[Tensor], None] | None = None,
) -> KVCommit:
    """Make the accepted nodes' K/V the request's next ``num_accepted`` logical rows (see module
    docstring). ``window`` = the rows this round wrote (verify width B+1, or the larger drafter
    block under spec-v2's shared reservation)."""
    rows = walk.tree_rows
    if rows is None or window < rows:
        raise ValueError(f"commit window {window} must cover the tree's {rows} verify rows")
    b = walk.accepted.shape[0]
    device = req_to_token.device
    idx = req_pool_indices.long().to(device).unsqueeze(1)
    prefix = prefix_lens.long().to(device)
    accepted = walk.accepted.to(device)
    cols = _window_cols(prefix, window)
    old = req_to_token[idx, cols].clone()
    moved = 0
    if page_size == 1:
        order = accepted_first_order(accepted, window)
        req_to_token[idx, cols] = old.gather(1, order)
    else:
        plan = commit_plan(walk, prefix, page_size=page_size, tree_rows=rows)
        copy = plan.copy.to(device)
        src = old.gather(1, plan.src.clamp(min=0).to(device))[copy].long()
        dst = old.gather(1, plan.dst.clamp(min=0).to(device))[copy].long()
        if src.numel():
            kv_pool.move_kv_cache(dst, src)
        moved = int(src.numel())
    new_len = prefix + walk.num_accepted.to(device)
    steps = accepted.shape[1]
    committed_cols = _window_cols(prefix, steps)
    live = torch.arange(steps, device=device).expand(b, steps) < walk.num_accepted.to(device).unsqueeze(1)
    committed = torch.where(live, req_to_token[idx, committed_cols.clamp(max=req_to_token.shape[1] - 1)], -1)
    released = torch.empty(0, dtype=torch.long, device=device)
    if release is not None:
        released = _release_tail(req_to_token, idx, prefix, new_len, window, page_size)
        if released.numel():
            release(released)
    return KVCommit(
        new_seq_lens=new_len, committed_slots=committed.long(), released=released, moved_rows=moved
    )


def _release_tail(
    req_to_token: Tensor, idx: Tensor, prefix: Tensor, new_len: Tensor, window: int, page_size: int
) -> Tensor:
    """Slots of the window past the committed length; page size > 1: only pages that hold no
    committed row (the page holding the last committed row stays)."""
    cols = _window_cols(prefix, window)
    end = (prefix + window).unsqueeze(1)
    if page_size == 1:
        start = new_len.unsqueeze(1)
    else:
        start = ((new_len + page_size - 1) // page_size * page_size).unsqueeze(1)
    tail = (cols >= start) & (cols < end)
    return req_to_token[idx, cols][tail].long()
