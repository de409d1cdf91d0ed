"""Verify inputs of every request in one launch: ids, positions, visibility, SGLang retrieve arrays.

Grid (request, block of RT rows). Each row's ancestors come from walking ``parents`` up at most L
steps; first child and next sibling are minima over the columns (children of a node are in
rank = pop order, so the smallest index is the first). Same results as ``tree.compile_tree``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _compile_kernel(
    tokens_ptr,  # [b, B]
    depths_ptr,  # [b, B]
    parents_ptr,  # [b, B+1]
    roots_ptr,  # [b]
    prefix_ptr,  # [b]
    ids_ptr,  # [b, B+1] out
    pos_ptr,  # [b, B+1] out
    vis_ptr,  # [b, B+1, B+1] bool out
    ridx_ptr,  # [b, B+1] out
    next_tok_ptr,  # [b, B+1] out
    next_sib_ptr,  # [b, B+1] out
    budget,
    horizon,
    RT: tl.constexpr,
    CT: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    n = budget + 1
    rows = tl.program_id(1) * RT + tl.arange(0, RT)
    rmask = rows < n
    node = rmask & (rows >= 1)
    par_base = parents_ptr + req * n
    par_r = tl.load(par_base + rows, mask=rmask, other=-1)
    tok = tl.load(tokens_ptr + req * budget + rows - 1, mask=node, other=0)
    dep = tl.load(depths_ptr + req * budget + rows - 1, mask=node, other=0)
    root = tl.load(roots_ptr + req)
    plen = tl.load(prefix_ptr + req)
    out = req * n + rows
    tl.store(ids_ptr + out, tl.where(rows == 0, root, tl.maximum(tok, 0)), mask=rmask)
    tl.store(pos_ptr + out, plen + dep, mask=rmask)
    tl.store(ridx_ptr + out, out, mask=rmask)
    big = 2**31 - 1
    first = tl.full([RT], big, tl.int64)
    nsib = tl.full([RT], big, tl.int64)
    for c0 in range(0, n, CT):
        cols = c0 + tl.arange(0, CT)
        cmask = cols < n
        par_c = tl.load(par_base + cols, mask=cmask, other=-2)
        vis = rows[:, None] == cols[None, :]
        anc = par_r
        for _ in range(horizon):
            vis = vis | ((anc[:, None] == cols[None, :]) & (anc[:, None] >= 0))
            anc = tl.load(par_base + anc, mask=anc >= 0, other=-1)
        vptr = vis_ptr + req * n * n + rows[:, None].to(tl.int64) * n + cols[None, :]
        tl.store(vptr, vis, mask=rmask[:, None] & cmask[None, :])
        is_child = par_c[None, :] == rows[:, None]
        first = tl.minimum(first, tl.min(tl.where(is_child, cols[None, :], big), axis=1))
        is_sib = (par_c[None, :] == par_r[:, None]) & (par_r[:, None] >= 0) & (cols[None, :] > rows[:, None])
        nsib = tl.minimum(nsib, tl.min(tl.where(is_sib, cols[None, :], big), axis=1))
    tl.store(next_tok_ptr + out, tl.where(first < big, first, -1), mask=rmask)
    tl.store(next_sib_ptr + out, tl.where(nsib < big, nsib, -1), mask=rmask)


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def compile_arrays(
    tokens: torch.Tensor,
    depths: torch.Tensor,
    parents: torch.Tensor,
    horizon: int,
    root_tokens: torch.Tensor,
    prefix_lens: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """(input_ids, positions, visibility, retrieve_index, next_token, next_sibling)."""
    b, budget = tokens.shape
    n = budget + 1
    dev = tokens.device
    roots = root_tokens.to(device=dev, dtype=torch.int64).reshape(b).contiguous()
    prefix = prefix_lens.to(device=dev, dtype=torch.int64).reshape(b).contiguous()
    ids = torch.empty((b, n), dtype=torch.int64, device=dev)
    pos = torch.empty_like(ids)
    ridx = torch.empty_like(ids)
    next_tok = torch.empty_like(ids)
    next_sib = torch.empty_like(ids)
    vis = torch.empty((b, n, n), dtype=torch.bool, device=dev)
    if b:
        ct = min(max(_pow2(n), 16), 512)
        rt = 16
        _compile_kernel[(b, triton.cdiv(n, rt))](
            tokens.contiguous(), depths.contiguous(), parents.contiguous(), roots, prefix,
            ids, pos, vis, ridx, next_tok, next_sib, budget, horizon, RT=rt, CT=ct, num_warps=4,
        )
    return ids, pos, vis, ridx, next_tok, next_sib
