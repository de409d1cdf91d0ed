"""Fused per-depth top-K and fp32 log-softmax over the full vocabulary: 3-4 launches, no big sorts.

Measured on the H200 (``scripts/kernels/primitives_bench.py``): inside one program a bitonic
``tl.sort`` of 1024 int64 keys costs ~9 us and ``tl.topk`` of 4096 -> 64 ~22 us, while one pass
over a row costs a few us. So nothing here sorts more than 4 K <= 512 keys:

1. ``_chunk_kernel``, grid (row, chunk of V): one streaming pass that keeps the chunk's max and
   sum-exp and appends every key above a running bound to a scratch buffer. When the buffer fills,
   the bound rises to the smallest of KC strided-group maxima of the buffer (at least KC keys
   are >= it) and the keys below it are dropped. A tile whose max is below the bound costs one
   load and two reductions.
1b. ``_exact_kernel`` (K <= 128), same grid: the chunk's exact top KC by a small ``tl.topk`` of
   at most 4 KC keys, so the rows' candidate lists stay short.
2. ``_gather_kernel``, one program per row: the row's logsumexp from the chunks' (max, sum-exp);
   tau = the highest chunk bound (the row's K-th key is above it); the chunks' keys above tau
   compacted into one candidate list.
3. ``_rank_kernel``, grid (row, P): every candidate's rank among the row's candidates by its
   key, (logit descending, id ascending), counted pairwise; rank < k writes its log-prob to its
   place. Ranks are unique (ids are), so the output is exactly the stable order. With ``RAW`` (a
   vocabulary shard's top-K under tensor parallelism, ``ddtree_runtime.core.tp_head``) it writes the
   logits themselves, and the row's max and sum-exp are the rest of the output.

Why rank by the logit and not by the rounded log-prob: log-prob order is logit order, except that
two logits an ulp apart can round to one fp32 log-prob, and whether they do depends on the last
bit of log(sum), i.e. on the order the sum was added up in (chunks here, shards under TP). With
the log-prob's tie to the lower id, the top-K's order, and at the cut its ids, then depended on
that bit (the H200 run of 2026-12-02 at K = 1023, V = 248320: sharded ids != these). The
logit's order depends on nothing computed, so every path ranks alike, and the log-probs, rounded
monotonically, stay non-increasing along it.

Keys are int64: order-preserving float bits, then the inverted id, so one integer comparison
orders by value and then by lower id. The log-prob is ``(x - max) - log(sum)`` in fp32 as
PyTorch's log_softmax computes it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_PAD_KEY = tl.constexpr(-(2**63))  # below every real key (a real -inf still sorts above it)
# Tile width by KC, measured on the H200: 4096 halves the chunk time for K = 1024 but costs ~20%
# for K = 64 (b1 B64 round 166 -> 204 us, b32 B64 1618 -> 1915 us).
TILE_SMALL_K, TILE_LARGE_K = 2048, 4096


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
def _tighten(scratch, count, KC: tl.constexpr, BLK: tl.constexpr):
    """Raise the buffer's bound and drop the keys below it (needs count >= KC).

    The new bound is the smallest of KC strided-group maxima (group g holds slots g, g + KC, ...:
    each has a real key, so at least KC keys are >= it). Returns (new count, new bound): the
    buffer then holds exactly the chunk's keys seen so far that are > bound, at least KC of them.
    Works in blocks of BLK slots: the whole buffer in registers spilled (255 registers + stack).
    """
    tl.debug_barrier()  # the appends (by every thread) are complete
    lanes = tl.arange(0, BLK)
    group_max = tl.full([KC], _PAD_KEY, tl.int64)
    for b0 in range(0, count, BLK):
        buf = tl.load(scratch + b0 + lanes, mask=b0 + lanes < count, other=_PAD_KEY)
        group_max = tl.maximum(group_max, tl.max(tl.reshape(buf, [BLK // KC, KC]), axis=0))
    bound = tl.min(group_max, axis=0) - 1
    kept = tl.full([], 0, tl.int32)
    for b0 in range(0, count, BLK):  # in place: a block's keys land at or before its own slots
        buf = tl.load(scratch + b0 + lanes, mask=b0 + lanes < count, other=_PAD_KEY)
        keep = (b0 + lanes < count) & (buf > bound)
        pos = kept + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.debug_barrier()  # every thread has read the block before it is overwritten
        tl.store(scratch + pos, buf, mask=keep)
        kept += tl.sum(keep.to(tl.int32), axis=0)
    count = kept
    tl.debug_barrier()
    return count, bound


@triton.jit
def _chunk_kernel(
    x_ptr,
    row_stride,
    vocab,
    chunk,
    n_chunks,
    scratch_ptr,  # [rows, n_chunks, CAP] int64
    count_ptr,  # [rows, n_chunks] int32: keys in the buffer
    bound_ptr,  # [rows, n_chunks] int64: the buffer holds every chunk key > bound
    max_ptr,
    sum_ptr,
    KC: tl.constexpr,
    TILE: tl.constexpr,
    CAP: tl.constexpr,
    FINAL: tl.constexpr,  # tighten down to this many keys at the end
    BLK: tl.constexpr,  # buffer block for tightening (a multiple of KC)
):
    row = tl.program_id(0)
    ch = tl.program_id(1)
    base = x_ptr + row.to(tl.int64) * row_stride
    slot = row.to(tl.int64) * n_chunks + ch
    scratch = scratch_ptr + slot * CAP
    start = ch * chunk
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    count = tl.full([], 0, tl.int32)
    bound = tl.full([], _PAD_KEY, tl.int64)
    bound_x = tl.full([], float("-inf"), tl.float32)  # value part of bound + 1: a cheap pre-filter
    for t in range(0, chunk, TILE):
        offs = start + t + tl.arange(0, TILE)
        mask = offs < vocab
        x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
        # Online max / sum-exp. (Per-lane accumulators, reduced once at the end, measured slower.)
        tile_max = tl.max(x, axis=0)
        new_m = tl.maximum(m, tile_max)
        safe = tl.where(new_m == float("-inf"), 0.0, new_m)  # all -inf so far: keep the sum at 0
        s = s * tl.exp(m - safe) + tl.sum(tl.exp(x - safe), axis=0)
        m = new_m
        if tile_max >= bound_x:  # some key of the tile may pass: the only per-tile branch
            pre = mask & (x >= bound_x)
            keys = _encode(x, offs)
            sel = pre & (keys > bound)
            n = tl.sum(sel.to(tl.int32), axis=0)
            if (count == 0) & (n == TILE):
                # First full tile: its KC strided-group maxima bound its KC-th key from below.
                bound = tl.min(tl.max(tl.reshape(keys, [TILE // KC, KC]), axis=0), axis=0) - 1
                sel = sel & (keys > bound)
                n = tl.sum(sel.to(tl.int32), axis=0)
            while count + n > CAP:  # no room: raise the bound (count > CAP - TILE >= 2 KC: progress)
                count, bound = _tighten(scratch, count, KC, BLK)
                sel = sel & (keys > bound)
                n = tl.sum(sel.to(tl.int32), axis=0)
            bound_x, _ = _decode(bound + 1)
            bound_x = tl.where(bound_x == bound_x, bound_x, float("-inf"))  # no bound yet: NaN bits
            pos = count + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            tl.store(scratch + pos, keys, mask=sel)
            count += n
    rounds = 0
    while (count > FINAL) & (rounds < 8):
        count, bound = _tighten(scratch, count, KC, BLK)
        rounds += 1
    tl.store(count_ptr + slot, count)
    tl.store(bound_ptr + slot, bound)
    tl.store(max_ptr + slot, m)
    tl.store(sum_ptr + slot, s)


@triton.jit
def _exact_kernel(scratch_ptr, count_ptr, bound_ptr, KC: tl.constexpr, CAP: tl.constexpr, EXN: tl.constexpr):
    """Per chunk holding KC < count <= EXN keys: keep its exact top KC (one small ``tl.topk``,
    ~2 us for 256 -> 64 on the H200). A launch of its own: inside the streaming kernel the
    bitonic network took its registers to 211 (2 programs per multiprocessor instead of 4)."""
    slot = tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
    count = tl.load(count_ptr + slot)
    if (count > KC) & (count <= EXN):
        scratch = scratch_ptr + slot * CAP
        i = tl.arange(0, EXN)
        top = tl.topk(tl.load(scratch + i, mask=i < count, other=_PAD_KEY), KC)
        tl.debug_barrier()  # every thread has read the buffer before it is overwritten
        tl.store(scratch + tl.arange(0, KC), top)  # the KC best, best first
        tl.store(count_ptr + slot, tl.full([], KC, tl.int32))
        tl.store(bound_ptr + slot, tl.min(top, axis=0) - 1)


@triton.jit
def _gather_kernel(
    scratch_ptr,
    count_ptr,
    bound_ptr,
    max_ptr,
    sum_ptr,
    n_chunks,
    cand_ptr,  # [rows, n_chunks * CAP] int64 out: the row's keys above tau
    ncand_ptr,  # [rows] int32 out
    lse_ptr,  # [rows, 3] fp32 out: max, log(sum-exp), sum-exp
    CAP: tl.constexpr,
    NCP: tl.constexpr,
    BJ: tl.constexpr,
    PRECISE_LOG: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
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
    tl.store(lse_ptr + row * 3, m)
    tl.store(lse_ptr + row * 3 + 1, log_sum)
    tl.store(lse_ptr + row * 3 + 2, total)
    tau = tl.max(tl.load(bound_ptr + row * n_chunks + cs, mask=cmask, other=_PAD_KEY), axis=0)
    counts = tl.load(count_ptr + row * n_chunks + cs, mask=cmask, other=0)
    out = cand_ptr + row * n_chunks * CAP
    # Every chunk's first BJ keys at once (the common case: each holds at most BJ), then the rest.
    js = tl.arange(0, BJ)
    blk = tl.load(
        scratch_ptr + (row * n_chunks + cs[:, None]) * CAP + js[None, :],
        mask=js[None, :] < counts[:, None],
        other=_PAD_KEY,
    )
    keep = tl.reshape(blk > tau, [NCP * BJ])
    blk = tl.reshape(blk, [NCP * BJ])
    pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(out + pos, blk, mask=keep)
    n = tl.sum(keep.to(tl.int32), axis=0)
    if tl.max(counts, axis=0) > BJ:
        for c in range(n_chunks):
            cnt = tl.load(count_ptr + row * n_chunks + c)
            for j0 in range(BJ, cnt, BJ):
                j = j0 + js
                key = tl.load(scratch_ptr + (row * n_chunks + c) * CAP + j, mask=j < cnt, other=_PAD_KEY)
                more = key > tau
                at = n + tl.cumsum(more.to(tl.int32), axis=0) - 1
                tl.store(out + at, key, mask=more)
                n += tl.sum(more.to(tl.int32), axis=0)
    tl.store(ncand_ptr + row, n)


@triton.jit
def _written(key, m, log_sum, RAW: tl.constexpr):
    """(value written, id) of a candidate key: its log-prob, or with RAW its logit."""
    x, ids = _decode(key)
    if RAW:
        return x, ids
    return (x - m) - log_sum, ids


@triton.jit
def _rank_kernel(
    cand_ptr,
    ncand_ptr,
    lse_ptr,
    cand_stride,
    k,
    lp_ptr,  # [rows, k] fp32 out (with RAW: the logits)
    ids_ptr,  # [rows, k] int64 out
    BI: tl.constexpr,
    BJ: tl.constexpr,
    RAW: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    n = tl.load(ncand_ptr + row)
    m = tl.load(lse_ptr + row * 3)
    log_sum = tl.load(lse_ptr + row * 3 + 1)
    cand = cand_ptr + row * cand_stride
    for i0 in range(part * BI, n, parts * BI):
        i = i0 + tl.arange(0, BI)
        ki = tl.load(cand + i, mask=i < n, other=_PAD_KEY)
        lp, ids = _written(ki, m, log_sum, RAW)
        rank = tl.zeros([BI], tl.int32)
        for j0 in range(0, n, BJ):  # by the logit's key, in both modes (see the module doc)
            j = j0 + tl.arange(0, BJ)
            kj = tl.load(cand + j, mask=j < n, other=_PAD_KEY)
            rank += tl.sum((kj[None, :] > ki[:, None]).to(tl.int32), axis=1)
        ok = (i < n) & (rank < k)
        tl.store(lp_ptr + row * k + rank, lp, mask=ok)
        tl.store(ids_ptr + row * k + rank, ids, mask=ok)


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def plan(rows: int, vocab: int, k: int, tile: int | None = None) -> tuple[int, int, int]:
    """(KC, TILE, chunk): per-chunk key count, tile width, chunk length (a multiple of TILE).

    Enough chunks to give every multiprocessor a couple of programs; few for a large K, whose
    chunk bounds are loose (each chunk keeps ~2 KC keys, and the row's candidates add up).
    """
    kc = max(_pow2(k), 16)
    tile = tile or (TILE_LARGE_K if kc >= 512 else TILE_SMALL_K)
    tile = max(min(tile, _pow2(vocab)), kc)  # at least KC: the first tile's group bound needs it
    tiles = triton.cdiv(vocab, tile)
    most = 16 if kc <= 128 else (4 if kc <= 256 else 2)
    # ...and chunks of at least 16 KC keys: the candidates (~2 KC per chunk) are ranked pairwise.
    most = min(most, max(1, vocab // (16 * kc)))
    want_chunks = max(1, min(tiles, triton.cdiv(264, max(rows, 1)), most))
    chunk = triton.cdiv(tiles, want_chunks) * tile
    return kc, tile, chunk


def topk_log_probs(
    logits: torch.Tensor,
    k: int,
    *,
    chunk: int | None = None,
    cap: int | None = None,
    tile: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., V]`` float logits -> (fp32 log-probs, int64 ids) ``[..., k]``, as tree.topk_log_probs.

    ``chunk`` (a multiple of the tile), ``cap`` (buffer slots per chunk, a power of two of at
    least 2 * KC + tile: small = frequent tightening) and ``tile`` override the plan, for tests.
    """
    launches, lp, ids, _ = topk_launches(logits, k, chunk=chunk, cap=cap, tile=tile)
    for _, launch in launches:
        launch()
    return lp, ids


@dataclasses.dataclass(frozen=True)
class Config:
    """Every size the top-K launches use for one (rows, V, k); see :func:`config`."""

    rows: int
    kc: int  # keys kept per chunk (power of two >= k)
    tile: int
    chunk: int
    n_chunks: int
    cap: int  # buffer slots per chunk
    final: int  # the chunk kernel tightens down to this many keys at the end
    exact: int  # K <= 128: the exact step takes up to this many keys (0: no exact step)
    warps: int  # of the chunk kernel
    gather_block: int
    rank_parts: int

    def chunk_constexprs(self) -> dict[str, int]:
        blk = max(self.kc, 1024)
        return {"KC": self.kc, "TILE": self.tile, "CAP": self.cap, "FINAL": self.final, "BLK": blk}

    def gather_constexprs(self) -> dict[str, int]:
        return {"CAP": self.cap, "NCP": max(_pow2(self.n_chunks), 2), "BJ": self.gather_block}


def config(
    rows: int,
    vocab: int,
    k: int,
    *,
    chunk: int | None = None,
    cap: int | None = None,
    tile: int | None = None,
) -> Config:
    """The launch sizes; ``chunk``, ``cap`` and ``tile`` override the plan (see topk_log_probs)."""
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, V={vocab}], got {k}")
    if tile is not None and (tile < 16 or tile & (tile - 1)):
        raise ValueError(f"tile must be a power of two >= 16, got {tile}")
    kc, tile, planned = plan(rows, vocab, k, tile)
    chunk = chunk or planned
    cap = cap or _pow2(2 * kc + tile)
    if cap < 2 * kc + tile or cap & (cap - 1):
        raise ValueError(f"cap must be a power of two >= 2 * KC + tile = {2 * kc + tile}, got {cap}")
    n_chunks = triton.cdiv(vocab, chunk)
    exact = 4 * kc if kc <= 128 else 0  # the exact KC-th by tl.topk over at most 4 KC keys
    # With the exact step the chunks keep KC keys each; without, up to 2 KC after tightening.
    block = kc if exact else 2 * kc
    return Config(
        rows=rows, kc=kc, tile=tile, chunk=chunk, n_chunks=n_chunks, cap=cap,
        final=exact or 2 * kc, exact=exact, warps=4 if cap <= 4096 else 8,
        gather_block=max(min(block, 4096 // max(_pow2(n_chunks), 2)), 16),
        rank_parts=max(1, min(triton.cdiv(n_chunks * kc, 64), triton.cdiv(1056, max(rows, 1)))),
    )


def topk_launches(
    logits: torch.Tensor,
    k: int,
    *,
    chunk: int | None = None,
    cap: int | None = None,
    tile: int | None = None,
    raw: bool = False,
) -> tuple[list[tuple[str, Callable[[], None]]], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 3-4 launches of :func:`topk_log_probs`, named, and its output tensors (values, ids,
    and ``[rows, 3]`` fp32 max / log(sum-exp) / sum-exp per row). ``raw``: the values are the top-k
    logits by (logit descending, id ascending) instead of log-probs (a vocabulary shard's list)."""
    vocab = logits.shape[-1]
    lead = logits.shape[:-1]
    x = logits.reshape(-1, vocab)
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    c = config(rows, vocab, k, chunk=chunk, cap=cap, tile=tile)
    dev = x.device
    scratch = torch.empty((rows, c.n_chunks, c.cap), dtype=torch.int64, device=dev)
    count = torch.empty((rows, c.n_chunks), dtype=torch.int32, device=dev)
    bound = torch.empty((rows, c.n_chunks), dtype=torch.int64, device=dev)
    cmax = torch.empty((rows, c.n_chunks), dtype=torch.float32, device=dev)
    csum = torch.empty((rows, c.n_chunks), dtype=torch.float32, device=dev)
    cand = torch.empty((rows, c.n_chunks * c.cap), dtype=torch.int64, device=dev)
    ncand = torch.empty((rows,), dtype=torch.int32, device=dev)
    lse = torch.empty((rows, 3), dtype=torch.float32, device=dev)
    lp = torch.empty((rows, k), dtype=torch.float32, device=dev)
    ids = torch.empty((rows, k), dtype=torch.int64, device=dev)
    if not rows:
        return [], lp.reshape(*lead, k), ids.reshape(*lead, k), lse
    precise = os.environ.get("TRITON_INTERPRET") != "1"

    def chunks() -> None:
        _chunk_kernel[(rows, c.n_chunks)](
            x, x.stride(0), vocab, c.chunk, c.n_chunks, scratch, count, bound, cmax, csum,
            **c.chunk_constexprs(), num_warps=c.warps,
        )

    def exact() -> None:
        _exact_kernel[(rows, c.n_chunks)](scratch, count, bound, KC=c.kc, CAP=c.cap, EXN=c.exact, num_warps=4)

    def gather() -> None:
        _gather_kernel[(rows,)](
            scratch, count, bound, cmax, csum, c.n_chunks, cand, ncand, lse,
            **c.gather_constexprs(), PRECISE_LOG=precise, num_warps=4,
        )

    def rank() -> None:
        _rank_kernel[(rows, c.rank_parts)](
            cand, ncand, lse, c.n_chunks * c.cap, k, lp, ids, BI=64, BJ=128, RAW=raw, num_warps=4
        )

    launches = [("topk_chunks", chunks)]
    if c.exact:
        launches.append(("topk_exact", exact))
    launches += [("topk_gather", gather), ("topk_rank", rank)]
    return launches, lp.reshape(*lead, k), ids.reshape(*lead, k), lse
