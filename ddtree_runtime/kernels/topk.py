"""Fused per-depth top-K and fp32 log-softmax over the full vocabulary (split-V, two launches).

Launch 1, one program per (row, chunk of V): an online max / sum-exp of the chunk and its local
top-K. Sorting every tile would cost far more than reading it, so the program first finds a lower
bound of its K-th key from group maxima, then sorts only the few keys above it (all keys of the
chunk when ties leave too many). Launch 2, one program per row: combine the chunks' (max,
sum-exp) into the row's logsumexp and merge their top-K lists into the row's. The logits are read
twice (the second time mostly from L2).

Order: log-prob descending, equal log-probs by ascending token id (``tree.topk_log_probs``).
Selection runs on 64-bit keys (order-preserving float bits, then the inverted id), so one integer
sort gives exactly that order; the log-prob is ``(x - max) - log(sum)`` in fp32 as PyTorch's
log_softmax computes it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_PAD_KEY = tl.constexpr(-(2**63))  # below every real key (a real -inf still sorts above it)


@triton.jit
def _encode(x, idx):
    """int64 key: float order first (-0.0 folded onto +0.0), then the lower id first."""
    x = x + 0.0
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (0xFFFFFFFF - idx.to(tl.int64))


@triton.jit
def _decode(key):
    ordered = (key >> 32).to(tl.int32)
    bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True), 0xFFFFFFFF - (key & 0xFFFFFFFF)


@triton.jit
def _chunk_kernel(
    x_ptr,
    row_stride,
    vocab,
    chunk,
    n_chunks,
    keys_ptr,
    max_ptr,
    sum_ptr,
    scratch_ptr,
    KC: tl.constexpr,
    TILE: tl.constexpr,
    CAP: tl.constexpr,
):
    row = tl.program_id(0)
    ch = tl.program_id(1)
    base = x_ptr + row.to(tl.int64) * row_stride
    start = ch * chunk
    # Pass 1: the chunk's max / sum-exp and the KC largest of its group maxima (groups of
    # TILE // KC keys). Their smallest, thr, is a lower bound of the chunk's KC-th key.
    group_top = tl.full([KC], _PAD_KEY, tl.int64)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    for t in range(0, chunk, TILE):
        offs = start + t + tl.arange(0, TILE)
        mask = offs < vocab
        x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        safe = tl.where(new_m == float("-inf"), 0.0, new_m)  # all -inf so far: keep the sum at 0
        s = s * tl.exp(m - safe) + tl.sum(tl.exp(x - safe), axis=0)
        m = new_m
        keys = tl.where(mask, _encode(x, offs), _PAD_KEY)
        group_max = tl.max(tl.reshape(keys, [KC, TILE // KC]), axis=1)
        group_top = tl.topk(tl.reshape(tl.join(group_top, group_max), [2 * KC]), KC)
    thr = tl.min(group_top, axis=0)
    # Pass 2 (the chunk again, from L2): compact the keys >= thr into this program's scratch.
    scratch = scratch_ptr + (row.to(tl.int64) * n_chunks + ch) * CAP
    count = tl.full([], 0, tl.int32)
    for t in range(0, chunk, TILE):
        offs = start + t + tl.arange(0, TILE)
        mask = offs < vocab
        x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
        keys = _encode(x, offs)
        sel = mask & (keys >= thr)
        pos = count + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(scratch + pos, keys, mask=sel & (pos < CAP))
        count += tl.sum(sel.to(tl.int32), axis=0)
    tl.debug_barrier()  # the scratch written above is read back by other threads
    if count <= CAP:
        slots = tl.arange(0, CAP)
        cand = tl.load(scratch + slots, mask=slots < count, other=_PAD_KEY)
        top = tl.topk(cand, KC)
    else:  # many equal values: select over the whole chunk, tile by tile
        top = tl.full([KC], _PAD_KEY, tl.int64)
        for t2 in range(0, chunk, TILE):
            offs2 = start + t2 + tl.arange(0, TILE)
            mask2 = offs2 < vocab
            x2 = tl.load(base + offs2, mask=mask2, other=float("-inf")).to(tl.float32)
            tile_top = tl.where(mask2, _encode(x2, offs2), _PAD_KEY)
            if TILE > KC:
                tile_top = tl.topk(tile_top, KC)
            top = tl.topk(tl.reshape(tl.join(top, tile_top), [2 * KC]), KC)
    out = (row.to(tl.int64) * n_chunks + ch) * KC
    tl.store(keys_ptr + out + tl.arange(0, KC), top)
    tl.store(max_ptr + row * n_chunks + ch, m)
    tl.store(sum_ptr + row * n_chunks + ch, s)


@triton.jit
def _merge_kernel(
    keys_ptr,
    max_ptr,
    sum_ptr,
    n_chunks,
    k,
    lp_ptr,
    ids_ptr,
    KC: tl.constexpr,
    NCP: tl.constexpr,
    NB: tl.constexpr,
    PRECISE_LOG: tl.constexpr,
):
    row = tl.program_id(0)
    cs = tl.arange(0, NCP)
    cmask = cs < n_chunks
    cm = tl.load(max_ptr + row * n_chunks + cs, mask=cmask, other=float("-inf"))
    csum = tl.load(sum_ptr + row * n_chunks + cs, mask=cmask, other=0.0)
    m = tl.max(cm, axis=0)
    safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(csum * tl.exp(cm - safe), axis=0)
    # libdevice's log (not the fast approximate one) keeps log-probs within an ulp of PyTorch's;
    # the CPU interpreter's tl.log is numpy's, precise already (it cannot run libdevice here).
    if PRECISE_LOG:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
        log_sum = libdevice.log(total)
    else:
        log_sum = tl.log(total)
    top = tl.full([KC], _PAD_KEY, tl.int64)
    base = keys_ptr + row.to(tl.int64) * n_chunks * KC
    lanes = tl.arange(0, KC)
    # NB chunks' lists per step: one wide sort instead of a long chain of small ones.
    for c0 in range(0, n_chunks, NB):
        cidx = c0 + tl.arange(0, NB)
        block = tl.load(
            base + cidx[:, None] * KC + lanes[None, :], mask=cidx[:, None] < n_chunks, other=_PAD_KEY
        )
        block = tl.reshape(block, [NB * KC])
        if NB > 1:
            block = tl.topk(block, KC)
        top = tl.topk(tl.reshape(tl.join(top, block), [2 * KC]), KC)
    x, ids = _decode(top)
    lp = (x - m) - log_sum
    # Re-sort by the log-prob itself: distinct logits can round to one log-prob, which then ties.
    ranks = tl.arange(0, KC)
    lp = tl.where(ranks < k, lp, float("-inf"))
    final = tl.sort(tl.where(ranks < k, _encode(lp, ids), _PAD_KEY), descending=True)
    lp, ids = _decode(final)
    out = row.to(tl.int64) * k
    tl.store(lp_ptr + out + ranks, lp, mask=ranks < k)
    tl.store(ids_ptr + out + ranks, ids, mask=ranks < k)


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def plan(rows: int, vocab: int, k: int) -> tuple[int, int, int]:
    """(KC, TILE, chunk): per-chunk list size, tile width, chunk length (a multiple of TILE).

    Enough chunks to give every multiprocessor a few programs, few enough that the merge stays short.
    """
    kc = max(_pow2(k), 16)
    tile = max(kc, 4096 if kc <= 256 else 2 * kc)
    tile = min(tile, max(_pow2(vocab), kc))
    tiles = triton.cdiv(vocab, tile)
    want_chunks = max(1, min(tiles, triton.cdiv(528, rows), 64))
    chunk = triton.cdiv(tiles, want_chunks) * tile
    return kc, tile, chunk


def topk_log_probs(
    logits: torch.Tensor, k: int, *, chunk: int | None = None, cap: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., V]`` float logits -> (fp32 log-probs, int64 ids) ``[..., k]``, as tree.topk_log_probs.

    ``chunk`` (a multiple of the tile) and ``cap`` (scratch slots per chunk; small = the exact
    fallback always) override the plan, for tests.
    """
    vocab = logits.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, V={vocab}], got {k}")
    lead = logits.shape[:-1]
    x = logits.reshape(-1, vocab)
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    kc, tile, planned = plan(rows, vocab, k)
    chunk = chunk or planned
    n_chunks = triton.cdiv(vocab, chunk)
    dev = x.device
    keys = torch.empty((rows, n_chunks, kc), dtype=torch.int64, device=dev)
    cap = cap or 4 * kc
    scratch = torch.empty((rows, n_chunks, cap), dtype=torch.int64, device=dev)
    cmax = torch.empty((rows, n_chunks), dtype=torch.float32, device=dev)
    csum = torch.empty((rows, n_chunks), dtype=torch.float32, device=dev)
    lp = torch.empty((rows, k), dtype=torch.float32, device=dev)
    ids = torch.empty((rows, k), dtype=torch.int64, device=dev)
    if rows:
        _chunk_kernel[(rows, n_chunks)](
            x, x.stride(0), vocab, chunk, n_chunks, keys, cmax, csum, scratch,
            KC=kc, TILE=tile, CAP=cap, num_warps=8,
        )
        _merge_kernel[(rows,)](
            keys, cmax, csum, n_chunks, k, lp, ids,
            KC=kc, NCP=max(_pow2(n_chunks), 2), NB=min(max(4096 // kc, 1), _pow2(n_chunks)),
            PRECISE_LOG=os.environ.get("TRITON_INTERPRET") != "1", num_warps=8,
        )
    return lp.reshape(*lead, k), ids.reshape(*lead, k)
