"""Commit a tree round's accepted KV into SGLang's pools (``ReqToTokenPool`` + token-to-KV pool).

The verify forward wrote node ``i`` of request ``r`` into the window slot ``slots[r, i]`` =
``req_to_token[r, prefix_r + i]`` (read BEFORE the verify). After the walk the accepted nodes (root
first, strictly increasing node indices) must sit at logical positions ``prefix_r .. prefix_r + a - 1``,
so node ``acc[k]``'s K/V moves from ``slots[r, acc[k]]`` to ``slots[r, k]`` (``move_kv_cache``, every
attention layer), for every page size. ``req_to_token`` is never written: under SGLang's overlap
scheduler a request that finished in the previous round still rides this one, and once the
verify's reads are done the scheduler may hand its row to a new request (SGLang's own comment on
EAGLE's compaction, ``spec_utils.move_accept_tokens_to_target_kvcache``), so rewriting the row
after the verify could clobber the new owner's mapping. The move is fixed-shape (``b * (L+1)``
entries, rows that stay put or pad point at slot 0, SGLang's dummy slot) and reads nothing back.
``acc[k] >= k`` and ``acc`` increases, so no entry reads a slot an earlier entry wrote (SGLang's
move also gathers before it scatters).

Where the rejected slots go depends on who owns them:

* SGLang spec-v2 (``DFlashWorkerV2`` and this plugin's worker): the scheduler reserves the verify
  window ahead of time (``DFlashDraftInputV2.prepare_for_decode``, ``alloc_for_spec_decode``) and
  frees the request's whole allocation when it finishes. Rejected slots stay in that reservation,
  past the committed length, and the next round overwrites them. Freeing them here would free
  them twice. ``release=None``.
* a caller that allocated the verify window for this round only (SGLang spec-v1 style, no overlap):
  pass ``release=allocator.free``; the slots (page 1) or whole pages (page > 1) past the committed
  length are handed back (a variable-length selection: this mode reads the device).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ddtree_runtime.core.tree import WalkResult


@dataclass(frozen=True)
class KVCommit:
    new_seq_lens: Tensor  # [b] prefix + committed rows
    committed_slots: Tensor  # [b, L+1] physical slot of committed logical row prefix + k, -1 padded
    window_slots: Tensor  # [b, L+1] slots of logical rows prefix .. prefix + L (all valid)
    released: Tensor  # flat slots handed to ``release`` (empty without one)
    moved_rows: int  # entries handed to move_kv_cache: b * (L+1), fixed (rows that stay put move 0 -> 0)


def window_slots(req_to_token: Tensor, req_pool_indices: Tensor, prefix_lens: Tensor, width: int) -> Tensor:
    """``[b, width]`` slots of each request's logical rows ``prefix .. prefix + width - 1``. Read
    them before the verify: afterwards the row may belong to another request (module docstring)."""
    device = req_to_token.device
    idx = req_pool_indices.long().to(device).unsqueeze(1)
    cols = prefix_lens.long().to(device).unsqueeze(1) + torch.arange(width, device=device)
    return req_to_token[idx, cols].long()


def accepted_moves(accepted: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
    """(dst, src) ``[b * (L+1)]`` for ``move_kv_cache``: node ``accepted[r, k]``'s slot to slot
    ``k``; entries that need no move (the node is already there, or padding) are 0 -> 0."""
    b, steps = accepted.shape
    k = torch.arange(steps, device=accepted.device).expand(b, steps)
    copy = (accepted >= 0) & (accepted != k)
    src = torch.where(copy, slots.gather(1, accepted.clamp(min=0)), 0)
    dst = torch.where(copy, slots[:, :steps], 0)
    return dst.reshape(-1), src.reshape(-1)


def commit_accepted_kv(
    walk: WalkResult,
    *,
    slots: Tensor,
    prefix_lens: Tensor,
    kv_pool: Any,
    page_size: int,
    req_to_token: Tensor | None = None,
    req_pool_indices: Tensor | None = None,
    release: Callable[[Tensor], None] | None = None,
) -> KVCommit:
    """Make the accepted nodes' K/V the request's next ``num_accepted`` logical rows (see module
    docstring). ``slots [b, W]``: the window's slots as read before the verify (``window_slots``),
    W >= the tree's verify rows and >= L + 1. ``req_to_token`` / ``req_pool_indices``: only for
    ``release``."""
    rows = walk.tree_rows
    b, steps = walk.accepted.shape
    if rows is None or slots.shape[1] < max(rows, steps):
        raise ValueError(f"commit window {tuple(slots.shape)} must cover the tree's {rows} verify rows")
    device = slots.device
    prefix = prefix_lens.long().to(device)
    accepted = walk.accepted.to(device)
    dst, src = accepted_moves(accepted, slots)
    kv_pool.move_kv_cache(dst, src)
    new_len = prefix + walk.num_accepted.to(device)
    live = torch.arange(steps, device=device).expand(b, steps) < walk.num_accepted.to(device).unsqueeze(1)
    front = slots[:, :steps]
    released = torch.empty(0, dtype=torch.long, device=device)
    if release is not None:
        if req_to_token is None or req_pool_indices is None:
            raise ValueError("release needs req_to_token and req_pool_indices")
        idx = req_pool_indices.long().to(device).unsqueeze(1)
        released = _release_tail(req_to_token, idx, prefix, new_len, int(slots.shape[1]), page_size)
        if released.numel():
            release(released)
    return KVCommit(
        new_seq_lens=new_len,
        committed_slots=torch.where(live, front, -1),
        window_slots=front,
        released=released,
        moved_rows=int(dst.numel()),
    )


def _release_tail(
    req_to_token: Tensor, idx: Tensor, prefix: Tensor, new_len: Tensor, window: int, page_size: int
) -> Tensor:
    """Slots of the window past the committed length; page size > 1: only pages that hold no
    committed row (the page holding the last committed row stays)."""
    cols = prefix.long().unsqueeze(1) + torch.arange(window, device=prefix.device)
    end = (prefix + window).unsqueeze(1)
    if page_size == 1:
        start = new_len.unsqueeze(1)
    else:
        start = ((new_len + page_size - 1) // page_size * page_size).unsqueeze(1)
    tail = (cols >= start) & (cols < end)
    return req_to_token[idx, cols][tail].long()
