"""Gated DeltaNet (GDN) maths in plain PyTorch: token by token, and over a draft tree by parent pointer.

The same recurrence SGLang 0.5.23 runs in ``causal_conv1d_update`` and
``fused_sigmoid_gating_delta_rule_update`` (Qwen3-Next / Qwen3.5 linear-attention layers):

* a depthwise causal conv of width ``W`` over the ``[q, k, v]`` channels (state: the last ``W - 1``
  inputs, oldest first), then SiLU;
* gates ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)`` per value head;
* the delta rule on a ``[K, V]`` state per value head: ``S *= exp(g)``;
  ``v' = beta * (v - k @ S)``; ``S += k^T v'``; ``o = (q / sqrt(K)) @ S``, with q and k
  L2-normalised first (eps 1e-6 under the square root). Query/key heads are shared by
  ``HV / H`` value heads.

Over a tree (rows in parent-before-child order, ``parents[:, 0] = -1``), every node starts from its
parent's post-token state and window (the root from the committed ones): exactly the path each node
would have seen decoding token by token. Padded nodes (parent -1 past the root) hang off the root,
as in SGLang's kernels; they are never accepted.

State layout here is ``[.., HV, K, V]``; SGLang's pools hold ``[.., HV, V, K]`` (transpose to compare).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def gates(A_log: Tensor, a: Tensor, dt_bias: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``a, b [.., HV]`` -> (log decay ``g``, write strength ``beta``), both ``[.., HV]`` float32."""
    x = a.float() + dt_bias.float()
    softplus = torch.where(x <= 20.0, torch.log1p(torch.exp(x.clamp(max=20.0))), x)
    return -torch.exp(A_log.float()) * softplus, torch.sigmoid(b.float())


def _l2norm(x: Tensor) -> Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def conv_step(window: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """One token through the causal conv. ``window [.., C, W-1]`` (oldest first), ``x [.., C]``,
    ``weight [C, W]`` -> (SiLU output ``[.., C]``, next window ``[.., C, W-1]``)."""
    full = torch.cat([window, x.unsqueeze(-1)], dim=-1)
    acc = (full.float() * weight.float()).sum(-1)
    if bias is not None:
        acc = acc + bias.float()
    return F.silu(acc), full[..., 1:]


def delta_step(
    state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor
) -> tuple[Tensor, Tensor]:
    """One token through the gated delta rule. ``state [.., HV, K, V]``; ``q, k [.., H, K]``;
    ``v [.., HV, V]``; ``g, beta [.., HV]`` -> (output ``[.., HV, V]``, next state)."""
    hv, h = v.shape[-2], q.shape[-2]
    rep = hv // h
    q = _l2norm(q.float()).repeat_interleave(rep, dim=-2) * q.shape[-1] ** -0.5
    k = _l2norm(k.float()).repeat_interleave(rep, dim=-2)
    s = state.float() * torch.exp(g)[..., None, None]
    delta = (v.float() - (k.unsqueeze(-1) * s).sum(-2)) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (q.unsqueeze(-1) * s).sum(-2), s


def split_qkv(mixed: Tensor, h: int, hv: int, k_dim: int, v_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Conv output ``[.., C]`` with ``C = 2*h*k_dim + hv*v_dim`` -> q, k ``[.., h, K]``, v ``[.., hv, V]``."""
    q, k, v = torch.split(mixed, [h * k_dim, h * k_dim, hv * v_dim], dim=-1)
    lead = mixed.shape[:-1]
    return q.reshape(*lead, h, k_dim), k.reshape(*lead, h, k_dim), v.reshape(*lead, hv, v_dim)


def node_depths(parents: Tensor) -> Tensor:
    """``parents [b, T]`` (-1 = none) -> depth per row (root 0; padded rows 1, as SGLang's kernels
    hang them off the root)."""
    b, t = parents.shape
    parent = _effective_parents(parents)
    depth = torch.zeros(b, t, dtype=torch.long, device=parents.device)
    for _ in range(t):
        nxt = torch.where(parent >= 0, depth.gather(1, parent.clamp(min=0)) + 1, depth)
        if torch.equal(nxt, depth):
            break
        depth = nxt
    return depth


def chain_parents(b: int, t: int, device: torch.device | str = "cpu") -> Tensor:
    """A plain sequence as a tree: row i's parent is row i - 1."""
    return torch.arange(-1, t - 1, device=device).expand(b, t)


def _effective_parents(parents: Tensor) -> Tensor:
    eff = parents.clone()
    eff[:, 1:] = eff[:, 1:].clamp(min=0)  # padded rows: parent = root (SGLang's default 0)
    return eff


def tree_scan(
    step: Callable[[tuple[Tensor, ...], Tensor, Tensor], tuple[Tensor, tuple[Tensor, ...]]],
    init: tuple[Tensor, ...],
    parents: Tensor,
    depths: Tensor | None = None,
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Run a recurrence over a tree, level by level: every row starts from its parent's state (the
    root from ``init``, one ``[b, ...]`` tensor per state part). ``step(before, batch_idx, row_idx)``
    gets the states of the rows of one depth (``[m, ...]``) and returns (output ``[m, ...]``,
    states after ``[m, ...]``). Returns outputs ``[b, T, ...]`` and per-row states ``[b, T, ...]``.
    Only index operations: autograd-friendly, and the work is one step per row."""
    b, t = parents.shape
    parent = _effective_parents(parents)
    depth = node_depths(parents) if depths is None else depths
    slot = torch.empty(b, t, dtype=torch.long, device=parents.device)
    outs: list[Tensor] = []
    afters: list[tuple[Tensor, ...]] = []
    flat: list[Tensor] = []
    for d in range(int(depth.max()) + 1):
        bi, ni = (depth == d).nonzero(as_tuple=True)
        slot[bi, ni] = torch.arange(bi.shape[0], device=parents.device)
        if d == 0:
            before = tuple(x[bi] for x in init)
        else:
            at = slot[bi, parent[bi, ni]]
            before = tuple(x[at] for x in afters[-1])
        out, after = step(before, bi, ni)
        outs.append(out)
        afters.append(after)
        flat.append(bi * t + ni)
    order = torch.argsort(torch.cat(flat))
    out = torch.cat(outs)[order]
    states = tuple(torch.cat(parts)[order] for parts in zip(*afters, strict=True))
    return out.reshape(b, t, *out.shape[1:]), tuple(x.reshape(b, t, *x.shape[1:]) for x in states)


def tree_conv(
    x: Tensor, window0: Tensor, weight: Tensor, bias: Tensor | None, parents: Tensor
) -> tuple[Tensor, Tensor]:
    """Causal conv over a tree. ``x [b, T, C]`` (row 0 = root), ``window0 [b, C, W-1]`` (committed),
    ``parents [b, T]`` -> (outputs ``[b, T, C]``, post-token windows ``[b, T, C, W-1]``)."""

    def step(before, bi, ni):
        out, window = conv_step(before[0], x[bi, ni], weight, bias)
        return out, (window,)

    out, (windows,) = tree_scan(step, (window0,), parents)
    return out, windows


def tree_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state0: Tensor, parents: Tensor
) -> tuple[Tensor, Tensor]:
    """Gated delta rule over a tree. ``q, k [b, T, H, K]``, ``v [b, T, HV, V]``, ``g, beta [b, T, HV]``,
    ``state0 [b, HV, K, V]`` (committed) -> (outputs ``[b, T, HV, V]``, post-token states
    ``[b, T, HV, K, V]``)."""

    def step(before, bi, ni):
        out, state = delta_step(before[0], q[bi, ni], k[bi, ni], v[bi, ni], g[bi, ni], beta[bi, ni])
        return out, (state,)

    out, (states,) = tree_scan(step, (state0.float(),), parents)
    return out, states


def chain_conv(x: Tensor, window0: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """``tree_conv`` for a plain sequence (row i's parent is row i - 1), in one convolution.
    ``x [b, T, C]``, ``window0 [b, C, W-1]`` -> (outputs ``[b, T, C]``, windows ``[b, T, C, W-1]``)."""
    w = weight.shape[-1]
    full = torch.cat([window0.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [b, C, W-1+T]
    out = F.conv1d(full.float(), weight.float().unsqueeze(1), bias.float() if bias is not None else None,
                   groups=weight.shape[0])  # fmt: skip
    windows = full.unfold(-1, w - 1, 1)[:, :, 1:]  # [b, C, T, W-1]: the last W-1 inputs after each row
    return F.silu(out).transpose(1, 2), windows.permute(0, 2, 1, 3)


def chain_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state0: Tensor
) -> tuple[Tensor, Tensor]:
    """``tree_delta_rule`` for a plain sequence: the same step, the normalisation hoisted out of the
    loop. Shapes as ``tree_delta_rule`` without ``parents``."""
    hv, h = v.shape[-2], q.shape[-2]
    rep = hv // h
    qn = _l2norm(q.float()).repeat_interleave(rep, dim=-2) * q.shape[-1] ** -0.5
    kn = _l2norm(k.float()).repeat_interleave(rep, dim=-2)
    decay, beta, v = torch.exp(g)[..., None, None], beta.float().unsqueeze(-1), v.float()
    s = state0.float()
    outs, states = [], []
    for t in range(q.shape[1]):
        s = s * decay[:, t]
        kt = kn[:, t].unsqueeze(-1)
        delta = (v[:, t] - (kt * s).sum(-2)) * beta[:, t]
        s = s + kt * delta.unsqueeze(-2)
        outs.append((qn[:, t].unsqueeze(-1) * s).sum(-2))
        states.append(s)
    return torch.stack(outs, 1), torch.stack(states, 1)
