"""Greedy walk and KV commit plan on the GPU.

Two ways to walk, same results (first occurrence on argmax ties, as ``torch.argmax``):

- full: the target argmax of every tree row, split-V (one program per (row, chunk)), then one walk
  program per request that merges the chunk results of the rows it visits. Reads all B + 1 rows.
- lazy: one launch per depth (L + 2 launches); launch j finds row j's accepted child from the
  partial argmax of the previous launch and computes only that row's argmax, split-V. Reads at
  most L + 1 rows per request: for large budgets and batches it reads a fraction of the bytes,
  for small ones the full pass is faster than the chain of launches.

The commit kernel turns the accepted indices into every field of ``tree.CommitPlan``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BIG = tl.constexpr(2**62)


@triton.jit
def _chunk_argmax(base, start, chunk, vocab, TILE: tl.constexpr):
    """(max, first index of it) of row ``base`` over [start, start + chunk), tile by tile."""
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 2**31 - 1, tl.int64)
    for t in range(0, chunk, TILE):
        offs = start + t + tl.arange(0, TILE)
        x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        i = tl.min(tl.where(x == m, offs, 2**31 - 1), axis=0).to(tl.int64)
        take = m > best  # strictly: an earlier tile keeps a tie
        best_idx = tl.where(take, i, best_idx)
        best = tl.where(take, m, best)
    return best, best_idx


@triton.jit
def _argmax_chunk_kernel(x_ptr, row_stride, vocab, chunk, n_chunks, max_ptr, idx_ptr, TILE: tl.constexpr):
    row = tl.program_id(0)
    ch = tl.program_id(1)
    best, best_idx = _chunk_argmax(x_ptr + row.to(tl.int64) * row_stride, ch * chunk, chunk, vocab, TILE)
    out = row.to(tl.int64) * n_chunks + ch
    tl.store(max_ptr + out, best)
    tl.store(idx_ptr + out, best_idx)


@triton.jit
def _row_argmax(max_ptr, idx_ptr, row, n_chunks, NCP: tl.constexpr):
    cs = tl.arange(0, NCP)
    cmask = cs < n_chunks
    vals = tl.load(max_ptr + row * n_chunks + cs, mask=cmask, other=float("-inf"))
    idxs = tl.load(idx_ptr + row * n_chunks + cs, mask=cmask, other=_BIG)
    m = tl.max(vals, axis=0)
    return tl.min(tl.where(vals == m, idxs, _BIG), axis=0)


@triton.jit
def _walk_kernel(
    tokens_ptr,  # [b, B]
    parents_ptr,  # [b, B+1]
    max_ptr,  # [b*(B+1), n_chunks]
    idx_ptr,
    n_chunks,
    budget,
    horizon,
    acc_ptr,  # [b, L+1] out
    num_ptr,  # [b] out
    bonus_ptr,  # [b] out
    emit_ptr,  # [b, L+1] out
    num_emit_ptr,  # [b] out
    BP: tl.constexpr,
    LP: tl.constexpr,
    NCP: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    nodes = tl.arange(0, BP)
    nmask = nodes < budget
    tok = tl.load(tokens_ptr + req * budget + nodes, mask=nmask, other=-1)
    par = tl.load(parents_ptr + req * (budget + 1) + 1 + nodes, mask=nmask, other=-1)
    steps = tl.arange(0, LP)
    acc = tl.where(steps == 0, 0, -1).to(tl.int64)
    emit = tl.full([LP], -1, tl.int64)
    cur = tl.full([], 0, tl.int64)
    live = tl.full([], 1, tl.int1)
    num = tl.full([], 1, tl.int64)
    row0 = req * (budget + 1)
    for s in range(horizon):
        post = _row_argmax(max_ptr, idx_ptr, row0 + cur, n_chunks, NCP)
        hit = nmask & (par == cur) & (tok == post)
        child = tl.min(tl.where(hit, (nodes + 1).to(tl.int64), _BIG), axis=0)
        live = live & (child < _BIG)
        acc = tl.where(live & (steps == s + 1), child, acc)
        emit = tl.where(live & (steps == s), post, emit)
        cur = tl.where(live, child, cur)
        num += live.to(tl.int64)
    bonus = _row_argmax(max_ptr, idx_ptr, row0 + cur, n_chunks, NCP)
    emit = tl.where(steps == num - 1, bonus, emit)
    width = horizon + 1
    smask = steps < width
    tl.store(acc_ptr + req * width + steps, acc, mask=smask)
    tl.store(emit_ptr + req * width + steps, emit, mask=smask)
    tl.store(num_ptr + req, num)
    tl.store(num_emit_ptr + req, num)
    tl.store(bonus_ptr + req, bonus)


@triton.jit
def _lazy_step_kernel(
    tokens_ptr,  # [b, B]
    parents_ptr,  # [b, B+1]
    x_ptr,  # target logits, rows [b * (B+1), V]
    row_stride,
    vocab,
    chunk,
    n_chunks,
    pmax_ptr,  # [L+2, b, n_chunks] fp32: partial argmax of each step's row
    pidx_ptr,  # [L+2, b, n_chunks] int64
    cur_ptr,  # [L+2, b] int64: the row visited at each step, -1 once the walk is over
    post_ptr,  # [L+1, b] int64: the target's token at each visited row
    acc_ptr,  # [b, L+1] out (written by the last step)
    num_ptr,
    bonus_ptr,
    emit_ptr,
    num_emit_ptr,
    step,
    batch,
    budget,
    horizon,
    BP: tl.constexpr,
    LP: tl.constexpr,
    NCP: tl.constexpr,
    TILE: tl.constexpr,
    LAST: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cur = tl.full([], 0, tl.int64)
    post = tl.full([], -1, tl.int64)
    if step > 0:
        prev = tl.load(cur_ptr + (step - 1) * batch + req)
        cur = tl.full([], -1, tl.int64)
        if prev >= 0:
            post = _row_argmax(pmax_ptr, pidx_ptr, (step - 1) * batch + req, n_chunks, NCP)
            nodes = tl.arange(0, BP)
            nmask = nodes < budget
            tok = tl.load(tokens_ptr + req * budget + nodes, mask=nmask, other=-1)
            par = tl.load(parents_ptr + req * (budget + 1) + 1 + nodes, mask=nmask, other=-1)
            child = tl.min(tl.where(nmask & (par == prev) & (tok == post), (nodes + 1).to(tl.int64), _BIG), 0)
            cur = tl.where(child < _BIG, child, -1)
            if part == 0:
                tl.store(post_ptr + (step - 1) * batch + req, post)
    if part == 0:
        tl.store(cur_ptr + step * batch + req, cur)
    if cur >= 0:
        base = x_ptr + (req * (budget + 1) + cur) * row_stride
        best, best_idx = _chunk_argmax(base, part * chunk, chunk, vocab, TILE)
        out = (step * batch + req) * n_chunks + part
        tl.store(pmax_ptr + out, best)
        tl.store(pidx_ptr + out, best_idx)
    if LAST:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if part == 0:
            # The walk: rows cur_0..cur_{num-1}, emitted tokens post_0..post_{num-1}.
            width = horizon + 1
            steps = tl.arange(0, LP)
            smask = steps < width
            rows = tl.load(cur_ptr + steps * batch + req, mask=smask, other=-1)
            prev_post = tl.load(post_ptr + steps * batch + req, mask=smask & (steps < step - 1), other=-1)
            posts = tl.where(steps == step - 1, post, prev_post)
            num = tl.sum((rows >= 0).to(tl.int64), axis=0)
            live = steps < num
            tl.store(acc_ptr + req * width + steps, tl.where(live, rows, -1), mask=smask)
            tl.store(emit_ptr + req * width + steps, tl.where(live, posts, -1), mask=smask)
            tl.store(num_ptr + req, num)
            tl.store(num_emit_ptr + req, num)
            tl.store(bonus_ptr + req, tl.sum(tl.where(steps == num - 1, posts, 0), axis=0))


@triton.jit
def _commit_kernel(
    acc_ptr,  # [b, W] accepted node indices, -1 padded
    num_ptr,  # [b]
    prefix_ptr,  # [b]
    rows,  # B + 1
    width,  # W = L + 1
    page,
    src_ptr,
    dst_ptr,
    num_rows_ptr,
    keep_ptr,  # [b, rows] bool
    copy_ptr,  # [b, W] bool
    src_loc_ptr,
    dst_loc_ptr,
    src_page_ptr,
    src_off_ptr,
    dst_page_ptr,
    dst_off_ptr,
    moves_ptr,  # [b, W, 2]
    new_len_ptr,
    free_start_ptr,
    free_end_ptr,
    WP: tl.constexpr,
    RT: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, WP)
    kmask = ks < width
    acc = tl.load(acc_ptr + req * width + ks, mask=kmask, other=-1)
    prev = tl.load(acc_ptr + req * width + ks - 1, mask=kmask & (ks >= 1), other=-1)
    num = tl.load(num_ptr + req)
    plen = tl.load(prefix_ptr + req)
    valid = acc >= 0
    dst = tl.where(valid, ks, -1).to(tl.int64)
    src_loc = tl.where(valid, plen + acc, -1)
    dst_loc = tl.where(valid, plen + ks, -1)
    src_page = tl.where(valid, src_loc // page, -1)
    dst_page = tl.where(valid, dst_loc // page, -1)
    copy = valid & (acc != ks)
    # Distinct (src_page, dst_page) pairs of cross-page copies: equal pairs are adjacent.
    cross = copy & (src_page != dst_page)
    prev_valid = prev >= 0
    prev_src_page = (plen + prev) // page
    prev_dst_page = (plen + ks - 1) // page
    prev_cross = prev_valid & (prev != ks - 1) & (prev_src_page != prev_dst_page)
    prev_same = prev_cross & (prev_src_page == src_page) & (prev_dst_page == dst_page)
    first = cross & ~prev_same
    slot = tl.cumsum(first.to(tl.int32), axis=0) - 1
    pick = first[None, :] & (slot[None, :] == ks[:, None])
    has = tl.max(pick.to(tl.int32), axis=1) > 0
    mv_src = tl.where(has, tl.sum(tl.where(pick, src_page[None, :], 0), axis=1), -1)
    mv_dst = tl.where(has, tl.sum(tl.where(pick, dst_page[None, :], 0), axis=1), -1)
    o = req * width + ks
    tl.store(src_ptr + o, acc, mask=kmask)
    tl.store(dst_ptr + o, dst, mask=kmask)
    tl.store(copy_ptr + o, copy, mask=kmask)
    tl.store(src_loc_ptr + o, src_loc, mask=kmask)
    tl.store(dst_loc_ptr + o, dst_loc, mask=kmask)
    tl.store(src_page_ptr + o, src_page, mask=kmask)
    tl.store(src_off_ptr + o, tl.where(valid, src_loc % page, -1), mask=kmask)
    tl.store(dst_page_ptr + o, dst_page, mask=kmask)
    tl.store(dst_off_ptr + o, tl.where(valid, dst_loc % page, -1), mask=kmask)
    tl.store(moves_ptr + o * 2, mv_src, mask=kmask)
    tl.store(moves_ptr + o * 2 + 1, mv_dst, mask=kmask)
    new_len = plen + num
    tl.store(num_rows_ptr + req, num)
    tl.store(new_len_ptr + req, new_len)
    tl.store(free_start_ptr + req, (new_len + page - 1) // page)
    tl.store(free_end_ptr + req, (plen + rows + page - 1) // page)
    for r0 in range(0, rows, RT):
        r = r0 + tl.arange(0, RT)
        kept = tl.max(((acc[None, :] == r[:, None]) & valid[None, :]).to(tl.int32), axis=1) > 0
        tl.store(keep_ptr + req * rows + r, kept, mask=r < rows)


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _rows(logits: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` -> ``[R, V]`` with unit stride along V (the kernels index rows by stride)."""
    x = logits.reshape(-1, logits.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _split_v(vocab: int, rows: int, programs: int) -> tuple[int, int, int]:
    """(tile, chunk, n_chunks): split each row's V into chunks so that rows x chunks ~ programs."""
    tile = min(4096, max(_pow2(vocab), 16))
    tiles = triton.cdiv(vocab, tile)
    want = max(1, min(tiles, triton.cdiv(programs, max(rows, 1)), 64))
    chunk = triton.cdiv(tiles, want) * tile
    return tile, chunk, triton.cdiv(vocab, chunk)


def target_argmax_partials(target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per (row, chunk) max and first index of ``[b, B+1, V]`` logits: ``([R, n], [R, n], n)``."""
    vocab = target_logits.shape[-1]
    x = _rows(target_logits)
    rows = x.shape[0]
    tile, chunk, n_chunks = _split_v(vocab, rows, 1056)
    cmax = torch.empty((rows, n_chunks), dtype=torch.float32, device=x.device)
    cidx = torch.empty((rows, n_chunks), dtype=torch.int64, device=x.device)
    if rows:
        _argmax_chunk_kernel[(rows, n_chunks)](
            x, x.stride(0), vocab, chunk, n_chunks, cmax, cidx, TILE=tile, num_warps=8
        )
    return cmax, cidx, n_chunks


def use_lazy_walk(batch: int, budget: int, horizon: int, vocab: int, elsize: int) -> bool:
    """Whether the per-depth walk beats the full argmax: ~2.5 us per launch against bytes read."""
    row = vocab * elsize
    full_us = batch * (budget + 1) * row / 3.5e6
    lazy_us = (horizon + 2) * 2.5 + batch * (horizon + 1) * row / 2.5e6
    return lazy_us < full_us


def walk_arrays(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    horizon: int,
    target_logits: torch.Tensor,
    *,
    lazy: bool | None = None,
):
    """(accepted, num_accepted, bonus, emitted, num_emitted) of the greedy walk.

    ``lazy``: the per-depth walk (True), the full argmax (False), or chosen by size (None).
    """
    b, budget = tokens.shape
    dev = tokens.device
    width = horizon + 1
    acc = torch.empty((b, width), dtype=torch.int64, device=dev)
    emit = torch.empty_like(acc)
    num = torch.empty((b,), dtype=torch.int64, device=dev)
    num_emit = torch.empty_like(num)
    bonus = torch.empty_like(num)
    if not b:
        return acc, num, bonus, emit, num_emit
    vocab = target_logits.shape[-1]
    if lazy is None:
        lazy = use_lazy_walk(b, budget, horizon, vocab, target_logits.element_size())
    tokens, parents = tokens.contiguous(), parents.contiguous()
    bp, lp = max(_pow2(budget), 16), max(_pow2(width), 16)
    if not lazy:
        cmax, cidx, n_chunks = target_argmax_partials(target_logits)
        _walk_kernel[(b,)](
            tokens, parents, cmax, cidx, n_chunks, budget, horizon,
            acc, num, bonus, emit, num_emit,
            BP=bp, LP=lp, NCP=max(_pow2(n_chunks), 2), num_warps=4,
        )
        return acc, num, bonus, emit, num_emit
    x = _rows(target_logits)
    tile, chunk, n_chunks = _split_v(vocab, b, 264)
    steps = horizon + 2
    pmax = torch.empty((steps, b, n_chunks), dtype=torch.float32, device=dev)
    pidx = torch.empty((steps, b, n_chunks), dtype=torch.int64, device=dev)
    cur = torch.empty((steps, b), dtype=torch.int64, device=dev)
    post = torch.empty((steps - 1, b), dtype=torch.int64, device=dev)
    for step in range(steps):
        _lazy_step_kernel[(b, n_chunks)](
            tokens, parents, x, x.stride(0), vocab, chunk, n_chunks, pmax, pidx, cur, post,
            acc, num, bonus, emit, num_emit, step, b, budget, horizon,
            BP=bp, LP=lp, NCP=max(_pow2(n_chunks), 2), TILE=tile, LAST=step == steps - 1, num_warps=4,
        )
    return acc, num, bonus, emit, num_emit


def commit_arrays(accepted: torch.Tensor, num_accepted: torch.Tensor, prefix_lens: torch.Tensor,
                  rows: int, page_size: int) -> dict[str, torch.Tensor]:
    """Every tensor field of ``tree.CommitPlan``, keyed by field name."""
    b, width = accepted.shape
    dev = accepted.device
    prefix = prefix_lens.to(device=dev, dtype=torch.int64).reshape(b).contiguous()

    def lw(dtype=torch.int64):
        return torch.empty((b, width), dtype=dtype, device=dev)

    f = {
        "src": lw(), "dst": lw(), "num_rows": torch.empty((b,), dtype=torch.int64, device=dev),
        "keep": torch.empty((b, rows), dtype=torch.bool, device=dev), "copy": lw(torch.bool),
        "src_loc": lw(), "dst_loc": lw(), "src_page": lw(), "src_offset": lw(), "dst_page": lw(),
        "dst_offset": lw(), "page_moves": torch.empty((b, width, 2), dtype=torch.int64, device=dev),
        "new_len": torch.empty((b,), dtype=torch.int64, device=dev),
        "free_page_start": torch.empty((b,), dtype=torch.int64, device=dev),
        "free_page_end": torch.empty((b,), dtype=torch.int64, device=dev),
    }
    if b:
        _commit_kernel[(b,)](
            accepted.contiguous(), num_accepted.contiguous(), prefix, rows, width, page_size,
            f["src"], f["dst"], f["num_rows"], f["keep"], f["copy"], f["src_loc"], f["dst_loc"],
            f["src_page"], f["src_offset"], f["dst_page"], f["dst_offset"], f["page_moves"],
            f["new_len"], f["free_page_start"], f["free_page_end"],
            WP=max(_pow2(width), 16), RT=256, num_warps=4,
        )
    return f
