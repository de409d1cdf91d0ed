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


def _effective_parents(parents: Tensor) -> Tensor:
    eff = parents.clone()
    eff[:, 1:] = eff[:, 1:].clamp(min=0)  # padded rows: parent = root (SGLang's default 0)
    return eff


def tree_conv(
    x: Tensor, window0: Tensor, weight: Tensor, bias: Tensor | None, parents: Tensor
) -> tuple[Tensor, Tensor]:
    """Causal conv over a tree. ``x [b, T, C]`` (row 0 = root), ``window0 [b, C, W-1]`` (committed),
    ``parents [b, T]`` -> (outputs ``[b, T, C]``, post-token windows ``[b, T, C, W-1]``)."""
    b, t, c = x.shape
    parent = _effective_parents(parents)
    depth = node_depths(parents)
    windows = window0.unsqueeze(1).expand(b, t, *window0.shape[1:]).clone()
    out = torch.empty(b, t, c, dtype=torch.float32, device=x.device)
    for d in range(int(depth.max()) + 1):
        at = depth == d
        if d == 0:
            before = window0.unsqueeze(1).expand_as(windows)
        else:
            before = windows.gather(1, parent.clamp(min=0)[:, :, None, None].expand_as(windows))
        o, w = conv_step(before, x, weight, bias)
        out = torch.where(at[:, :, None], o, out)
        windows = torch.where(at[:, :, None, None], w.to(windows.dtype), windows)
    return out, windows


def tree_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state0: Tensor, parents: Tensor
) -> tuple[Tensor, Tensor]:
    """Gated delta rule over a tree. ``q, k [b, T, H, K]``, ``v [b, T, HV, V]``, ``g, beta [b, T, HV]``,
    ``state0 [b, HV, K, V]`` (committed) -> (outputs ``[b, T, HV, V]``, post-token states
    ``[b, T, HV, K, V]``)."""
    b, t = parents.shape
    parent = _effective_parents(parents)
    depth = node_depths(parents)
    states = state0.float().unsqueeze(1).expand(b, t, *state0.shape[1:]).clone()
    out = torch.empty(*v.shape, dtype=torch.float32, device=v.device)
    for d in range(int(depth.max()) + 1):
        at = depth == d
        if d == 0:
            before = state0.float().unsqueeze(1).expand_as(states)
        else:
            idx = parent.clamp(min=0)[:, :, None, None, None].expand_as(states)
            before = states.gather(1, idx)
        o, s = delta_step(before, q, k, v, g, beta)
        out = torch.where(at[:, :, None, None], o, out)
        states = torch.where(at[:, :, None, None, None], s, states)
    return out, states
