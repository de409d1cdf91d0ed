"""Best-first DDTree build for every request in one launch: one program per request.

The program keeps the reference heap's frontier in registers (``F`` slots, ``F >= budget``): a
pop is one reduction over the slots, the popped slot takes the next sibling, and a free slot
takes the first child, exactly as the heap of ddtree-algorithm.md section 2. Scores are fp64 sums
of the fp32 log-probs along the root path (exact, as in ``tree.build_tree``); ties go to the
lexicographically smaller ranks tuple, packed as 11-bit digits (rank + 1, 0 = end) in three
int64 words, so L <= 15 and K <= 2047.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_HORIZON = 15
MAX_TOPK = 2047
_INVALID = tl.constexpr(2**63 - 1)  # the first ranks word of an empty slot: loses every tie
_LOG_PROB_FLOOR = tl.constexpr(-1e300)  # -inf log-probs clamp here so that sums stay comparable (as tree.py)


@triton.jit
def _better(s_a, a0, a1, a2, s_b, b0, b1, b2):
    return (s_a > s_b) | (
        (s_a == s_b) & ((a0 < b0) | ((a0 == b0) & ((a1 < b1) | ((a1 == b1) & (a2 < b2)))))
    )


@triton.jit
def _pick(s_a, a0, a1, a2, ps_a, meta_a, slot_a, s_b, b0, b1, b2, ps_b, meta_b, slot_b):
    win = _better(s_a, a0, a1, a2, s_b, b0, b1, b2)
    return (
        tl.where(win, s_a, s_b),
        tl.where(win, a0, b0),
        tl.where(win, a1, b1),
        tl.where(win, a2, b2),
        tl.where(win, ps_a, ps_b),
        tl.where(win, meta_a, meta_b),
        tl.where(win, slot_a, slot_b),
    )


@triton.jit
def _digit(pos, w: tl.constexpr):
    """The +1 at ranks-tuple position ``pos`` (0-based depth) inside word ``w``, as int64."""
    shift = ((4 - pos % 5) * 11).to(tl.int64)
    return tl.where(pos // 5 == w, tl.full([], 1, tl.int64) << shift, 0)


@triton.jit
def _build_kernel(
    lp_ptr,  # [b, L, K] fp32, sorted descending per depth
    ids_ptr,  # [b, L, K] int64
    horizon,
    k,
    budget,
    tokens_ptr,  # [b, B] int64
    depths_ptr,  # [b, B] int64
    parents_ptr,  # [b, B+1] int64
    scores_ptr,  # [b, B] fp32
    ranks_ptr,  # [b, B] int64 scratch: rank of each node, for the token gather
    F: tl.constexpr,
    BP: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    lp_row = lp_ptr + req * horizon * k
    slots = tl.arange(0, F)
    neg = float("-inf")
    floor = _LOG_PROB_FLOOR
    # Slot 0: the first child of the root (depth 1, rank 0).
    first = tl.maximum(tl.load(lp_row).to(tl.float64), floor)
    score = tl.where(slots == 0, first, neg).to(tl.float64)
    pscore = tl.zeros([F], tl.float64)
    w0 = tl.where(slots == 0, tl.full([F], 1, tl.int64) << 44, _INVALID)
    w1 = tl.zeros([F], tl.int64)
    w2 = tl.zeros([F], tl.int64)
    meta = tl.where(slots == 0, tl.full([F], 1, tl.int64) << 24, 0)  # parent | depth << 24 | rank << 32
    next_slot = 1
    for n in range(1, budget + 1):
        bs, b0, b1, b2, bps, bmeta, slot = tl.reduce((score, w0, w1, w2, pscore, meta, slots), 0, _pick)
        valid = b0 != _INVALID
        parent = bmeta & 0xFFFFFF
        depth = (bmeta >> 24) & 0xFF
        rank = bmeta >> 32
        out = req * budget + n - 1
        tl.store(depths_ptr + out, tl.where(valid, depth, 0))
        tl.store(parents_ptr + req * (budget + 1) + n, tl.where(valid, parent, -1))
        tl.store(scores_ptr + out, tl.where(valid, bs.to(tl.float32), neg))
        tl.store(ranks_ptr + out, tl.where(valid, rank, -1))
        pos = depth - 1
        # The popped slot takes the next sibling (same parent, rank + 1) or empties.
        has_sib = valid & (rank + 1 < k)
        sib_lp = tl.load(lp_row + pos * k + rank + 1, mask=has_sib, other=0.0).to(tl.float64)
        at = slots == slot
        score = tl.where(at, tl.where(has_sib, bps + tl.maximum(sib_lp, floor), neg), score)
        w0 = tl.where(at, tl.where(has_sib, b0 + _digit(pos, 0), _INVALID), w0)
        w1 = tl.where(at, b1 + _digit(pos, 1), w1)
        w2 = tl.where(at, b2 + _digit(pos, 2), w2)
        meta = tl.where(at, bmeta + (tl.full([], 1, tl.int64) << 32), meta)
        # A free slot takes the first child (parent n, depth + 1, rank 0).
        has_child = valid & (depth < horizon) & (next_slot < F)
        child_lp = tl.load(lp_row + depth * k, mask=has_child, other=0.0).to(tl.float64)
        at = (slots == next_slot) & has_child
        score = tl.where(at, bs + tl.maximum(child_lp, floor), score)
        pscore = tl.where(at, bs, pscore)
        w0 = tl.where(at, b0 + _digit(pos + 1, 0), w0)
        w1 = tl.where(at, b1 + _digit(pos + 1, 1), w1)
        w2 = tl.where(at, b2 + _digit(pos + 1, 2), w2)
        meta = tl.where(at, n + ((depth + 1) << 24), meta)
        next_slot += has_child.to(tl.int32)
    tl.store(parents_ptr + req * (budget + 1), -1)
    tl.debug_barrier()  # the scalar stores above come from one thread; the gather below reads all
    nodes = tl.arange(0, BP)
    nmask = nodes < budget
    depth = tl.load(depths_ptr + req * budget + nodes, mask=nmask, other=0)
    rank = tl.load(ranks_ptr + req * budget + nodes, mask=nmask, other=-1)
    live = nmask & (depth > 0)
    tok = tl.load(ids_ptr + (req * horizon + depth - 1) * k + rank, mask=live, other=-1)
    tl.store(tokens_ptr + req * budget + nodes, tl.where(live, tok, -1), mask=nmask)


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def build_from_topk(top_lp: torch.Tensor, top_ids: torch.Tensor, budget: int):
    """(tokens, depths, parents, scores, num_nodes) from per-depth top-K ``[b, L, K]`` lists."""
    b, horizon, k = top_lp.shape
    if horizon > MAX_HORIZON or k > MAX_TOPK:
        raise ValueError(
            f"the tree kernel takes L <= {MAX_HORIZON} and K <= {MAX_TOPK}, got L={horizon}, K={k}; "
            "set DDTREE_DISABLE_KERNELS=1 for the plain path"
        )
    dev = top_lp.device
    top_lp = top_lp.contiguous()
    top_ids = top_ids.contiguous()
    tokens = torch.empty((b, budget), dtype=torch.int64, device=dev)
    depths = torch.empty((b, budget), dtype=torch.int64, device=dev)
    parents = torch.empty((b, budget + 1), dtype=torch.int64, device=dev)
    scores = torch.empty((b, budget), dtype=torch.float32, device=dev)
    ranks = torch.empty((b, budget), dtype=torch.int64, device=dev)
    if b:
        f = max(_pow2(budget), 16)
        _build_kernel[(b,)](
            top_lp, top_ids, horizon, k, budget, tokens, depths, parents, scores, ranks,
            F=f, BP=f, num_warps=1 if f <= 128 else (2 if f <= 512 else 4),
        )
    # Prefixes run out only when L * K-paths < B: the count is static, so no device read is needed.
    n = min(budget, _num_prefixes(horizon, k))
    return tokens, depths, parents, scores, torch.full((b,), n, dtype=torch.int64, device=dev)


def _num_prefixes(horizon: int, k: int) -> int:
    total, level = 0, 1
    for _ in range(horizon):
        level *= k
        total += level
        if total > 2**40:
            break
    return total
