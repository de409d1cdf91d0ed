"""Tiny real models for the lab: a Qwen3-style target (dense, or hybrid in the Qwen3.5 pattern) and a
DFlash-style drafter.

The dense target is a Qwen3 decoder (GQA, q/k RMSNorm, RoPE, SwiGLU) with HF parameter names. The hybrid
target replaces three of every four attention layers with Gated DeltaNet layers (Qwen3.5's
``full_attention_interval`` 4): a causal conv and a gated delta-rule recurrence whose state the engine
keeps per request (``RecurrentCache``); over a draft tree every node starts from its parent's state
(``ddtree_runtime.tiny_engine.gdn``, the recurrence SGLang's GDN tree kernels run). The drafter follows
z-lab's `DFlashDraftModel`: no embedding and no LM head of its own (it borrows the target's), context
features = target hidden states after `target_layer_ids`, concatenated and projected by `fc` + `hidden_norm`,
injected as extra K/V in every layer; attention over [context, block] is non-causal.

Both forwards take explicit rows/masks so the engine can run prefill, chain verify and tree verify with a KV
cache (``kv_cache``), batched with different lengths, through the same code the models were trained with.
The configs the networks are built from, and the checkpoints' ``config.json``, are ``model_config``'s.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

from ddtree_runtime.tiny_engine import gdn
from ddtree_runtime.tiny_engine.kv_cache import KVCache, RecurrentCache
from ddtree_runtime.tiny_engine.model_config import DraftConfig, TargetConfig, load_target_config, read_config

# Qwen3.5's decoder norms scale by 1 + weight (its GDN layer's gated norm does not).
QWEN3_5_NORM_OFFSET = 1.0


class RMSNorm(nn.Module):
    """``offset`` 1.0 is Qwen3.5's convention (``Qwen3_5RMSNorm``, SGLang's ``GemmaRMSNorm``): the scale is
    ``1 + weight``, so a checkpoint's norm weights mean what SGLang's Qwen3.5 class reads them as."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))
        self.eps = eps
        self.offset = offset

    def forward(self, x: Tensor) -> Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * (self.weight + self.offset if self.offset else self.weight)


def apply_rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """x [b, h, n, d], positions [b, n] (absolute; tree siblings share one)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.to(torch.float32)[:, None, :, None] * inv  # [b, 1, n, d/2]
    cos, sin = torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attend(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
    """q [b, hq, n, d]; k, v [b, hkv, S, d]; allowed [b, n, S] bool (True = may attend) -> [b, n, hq*d]."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None, :, :])
    b, h, n, d = out.shape
    return out.transpose(1, 2).reshape(b, n, h * d)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Qwen3 attention projections; the caller decides where K/V come from and who sees whom."""

    def __init__(
        self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, offset: float = 0.0
    ) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps, offset)
        self.k_norm = RMSNorm(head_dim, eps, offset)

    def _split(self, x: Tensor, heads: int) -> Tensor:
        b, n, _ = x.shape
        return x.view(b, n, heads, self.head_dim).transpose(1, 2)

    def queries(self, x: Tensor, positions: Tensor, theta: float) -> Tensor:
        return apply_rope(self.q_norm(self._split(self.q_proj(x), self.heads)), positions, theta)

    def keys_values(self, x: Tensor, positions: Tensor, theta: float) -> tuple[Tensor, Tensor]:
        k = apply_rope(self.k_norm(self._split(self.k_proj(x), self.kv_heads)), positions, theta)
        return k, self._split(self.v_proj(x), self.kv_heads)


class DecoderLayer(nn.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim, inter, eps, offset: float = 0.0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps, offset)
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim, eps, offset)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset)
        self.mlp = SwiGLU(hidden, inter)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention layer (HF parameter names): q/k/v through a causal depthwise conv,
    the gated delta rule per value head, an RMS-normed output gated by SiLU(z)."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        h, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        kd, vd, w = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
        self.dims = (h, hv, kd, vd)
        self.conv_dim = 2 * h * kd + hv * vd
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, hv * vd, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, hv, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, hv, bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(self.conv_dim, 1, w))
        self.dt_bias = nn.Parameter(torch.zeros(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = RMSNorm(vd, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(hv * vd, cfg.hidden_size, bias=False)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        _, hv, kd, vd = self.dims
        return (self.conv_dim, self.conv1d.weight.shape[-1] - 1), (hv, kd, vd)

    def forward(
        self, x: Tensor, tree: tuple[Tensor, Tensor] | None, window0: Tensor, state0: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x [b, n, H]; the rows form a tree (``tree = (parents, depths)``, each ``[b, n]``) or, with
        ``tree=None``, a plain sequence, whose root continues from (window0 [b, C, W-1], state0
        [b, HV, K, V]). Returns the layer output [b, n, H] and every row's post-token (window, state)."""
        h, hv, kd, vd = self.dims
        mixed, z = self.in_proj_qkv(x), self.in_proj_z(x)
        g, beta = gdn.gates(self.A_log, self.in_proj_a(x), self.dt_bias, self.in_proj_b(x))
        weight = self.conv1d.weight[:, 0, :]
        if tree is None:
            conv_out, windows = gdn.chain_conv(mixed, window0, weight, None)
            q, k, v = gdn.split_qkv(conv_out, h, hv, kd, vd)
            out, states = gdn.chain_delta_rule(q, k, v, g, beta, state0)
        else:

            def step(before, bi, ni):
                conv_out, window = gdn.conv_step(before[0], mixed[bi, ni], weight, None)
                q, k, v = gdn.split_qkv(conv_out, h, hv, kd, vd)
                out, state = gdn.delta_step(before[1], q, k, v, g[bi, ni], beta[bi, ni])
                return out, (window, state)

            out, (windows, states) = gdn.tree_scan(step, (window0, state0), *tree)
        b, n = x.shape[:2]
        out = self.norm(out.to(x.dtype)) * F.silu(z.view(b, n, hv, vd))
        return self.out_proj(out.reshape(b, n, hv * vd)), windows, states


class GDNDecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, QWEN3_5_NORM_OFFSET)
        self.linear_attn = GatedDeltaNet(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, QWEN3_5_NORM_OFFSET)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)


class TargetModel(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        offset = QWEN3_5_NORM_OFFSET if cfg.is_hybrid else 0.0  # a hybrid is a Qwen3.5 checkpoint
        self.model.layers = nn.ModuleList(
            GDNDecoderLayer(cfg)
            if cfg.layer_type(i) == "linear_attention"
            else DecoderLayer(
                cfg.hidden_size,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                cfg.intermediate_size,
                cfg.rms_norm_eps,
                offset,
            )
            for i in range(cfg.num_hidden_layers)
        )
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.gdn_layers = [i for i in range(cfg.num_hidden_layers) if cfg.layer_type(i) == "linear_attention"]

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        c = self.cfg
        like = self.lm_head.weight
        recurrent = None
        if self.gdn_layers:
            shapes = [self.model.layers[i].linear_attn.state_shapes() for i in self.gdn_layers]
            recurrent = RecurrentCache(shapes, batch, like)
        kv_heads, head_dim = c.num_key_value_heads, c.head_dim
        return KVCache(c.num_hidden_layers, batch, kv_heads, head_dim, capacity, like, recurrent)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        allowed: Tensor,
        *,
        cache: KVCache | None = None,
        rows: Tensor | None = None,
        capture_layer_ids: tuple[int, ...] = (),
        parents: Tensor | None = None,
    ) -> tuple[Tensor, list[Tensor]]:
        """input_ids/positions [b, n]. Without a cache, allowed is [b, n, n]; with one, the new K/V go to
        cache `rows` [b, n] and allowed is [b, n, S] over cache rows 0..S-1.
        GDN layers (hybrid targets) run the rows as a tree: ``parents [b, n]`` (default: a chain), the
        root continuing from the cache's committed recurrent state (zeros without a cache); the cache
        stages every row's state for ``KVCache.commit_recurrent``.
        Returns logits [b, n, V] and the residual stream after each layer in capture_layer_ids."""
        h = self.model.embed_tokens(input_ids)
        theta = self.cfg.rope_theta
        captured: dict[int, Tensor] = {}
        b = input_ids.shape[0]
        tree = (parents, gdn.node_depths(parents)) if self.gdn_layers and parents is not None else None
        recurrent = cache.recurrent if cache is not None else None
        for i, layer in enumerate(self.model.layers):
            x = layer.input_layernorm(h)
            if isinstance(layer, GDNDecoderLayer):
                gi = self.gdn_layers.index(i)
                lin = layer.linear_attn
                if recurrent is not None:
                    window0, state0 = recurrent.conv[gi], recurrent.ssm[gi]
                else:
                    (cshape, sshape) = lin.state_shapes()
                    window0 = x.new_zeros((b, *cshape))
                    state0 = torch.zeros((b, *sshape), dtype=torch.float32, device=x.device)
                out, windows, states = lin(x, tree, window0, state0)
                if recurrent is not None:
                    recurrent.stage(gi, windows, states)
                h = h + out
                h = h + layer.mlp(layer.post_attention_layernorm(h))
                if i in capture_layer_ids:
                    captured[i] = h
                continue
            attn = layer.self_attn
            q = attn.queries(x, positions, theta)
            k, v = attn.keys_values(x, positions, theta)
            if cache is not None:
                cache.write(i, rows, k, v)
                k, v = cache.view(i, allowed.shape[-1])
            h = h + attn.o_proj(attend(q, k, v, allowed))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if i in capture_layer_ids:
                captured[i] = h
        return self.lm_head(self.model.norm(h)), [captured[i] for i in capture_layer_ids]


class DraftModel(nn.Module):
    """DFlash drafter: parameter names as in z-lab checkpoints (fc, hidden_norm, layers.*, norm)."""

    def __init__(self, cfg: DraftConfig, target_hidden_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        k = len(cfg.target_layer_ids)
        self.fc = nn.Linear(k * target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(
            DecoderLayer(
                cfg.hidden_size,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                cfg.intermediate_size,
                cfg.rms_norm_eps,
            )
            for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def project(self, target_hidden: Tensor) -> Tensor:
        """[.., k*H_target] -> [.., H_draft]; the width check lives in the contract guard, run before this."""
        return self.hidden_norm(self.fc(target_hidden))

    def context_kv(self, projected: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per layer K/V of context tokens (KV injection): k_norm + RoPE at their absolute positions."""
        theta = self.cfg.rope_theta
        return [layer.self_attn.keys_values(projected, positions, theta) for layer in self.layers]

    def forward(
        self,
        block_embeds: Tensor,
        block_positions: Tensor,
        context: list[tuple[Tensor, Tensor]],
        context_valid: Tensor,
    ) -> Tensor:
        """block_embeds [b, n, H] (target embeddings of [bonus, MASK...]); context per layer K/V [b, h, C, d];
        context_valid [b, C]. Non-causal: every block slot sees all valid context and the whole block.
        Returns the normed block hidden states [b, n, H] (logits = target lm_head of these)."""
        theta = self.cfg.rope_theta
        b, n, _ = block_embeds.shape
        allowed = torch.cat(
            [context_valid[:, None, :].expand(b, n, -1), context_valid.new_ones(b, n, n)], dim=-1
        )
        h = block_embeds
        for layer, (ck, cv) in zip(self.layers, context, strict=True):
            x = layer.input_layernorm(h)
            attn = layer.self_attn
            q = attn.queries(x, block_positions, theta)
            bk, bv = attn.keys_values(x, block_positions, theta)
            k, v = torch.cat([ck, bk], dim=2), torch.cat([cv, bv], dim=2)
            h = h + attn.o_proj(attend(q, k, v, allowed))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)


def causal_mask(n: int, device: torch.device | str = "cpu") -> Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def init_weights(module: nn.Module, generator: torch.Generator) -> None:
    """Seeded init independent of torch's global RNG (so make-models is byte-deterministic)."""
    for name, p in sorted(module.named_parameters()):
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0 - _norm_offset(module, name))
            else:
                std = 0.02 if "embed" in name else 1.0 / math.sqrt(p.shape[-1])
                p.copy_(torch.randn(p.shape, generator=generator) * std)


def _norm_offset(module: nn.Module, param_name: str) -> float:
    owner = module.get_submodule(param_name.rsplit(".", 1)[0])
    return float(getattr(owner, "offset", 0.0))



def load_target(directory: str | Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A Qwen3-style lab target from config.json + model.safetensors (strict: every tensor must fit)."""
    directory = Path(directory)
    cfg = load_target_config(directory)
    model = TargetModel(cfg)
    model.load_state_dict(load_file(str(directory / "model.safetensors")), strict=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load_draft(
    directory: str | Path, target_hidden_size: int, *, device: str = "cpu", dtype: torch.dtype = torch.float32
):
    """A DFlash-style lab drafter; a checkpoint made for another target fails here like SGLang's loader."""
    directory = Path(directory)
    cfg = DraftConfig.from_hf(read_config(directory))
    model = DraftModel(cfg, target_hidden_size)
    state = load_file(str(directory / "model.safetensors"))
    want = tuple(model.fc.weight.shape)
    got = tuple(state["fc.weight"].shape) if "fc.weight" in state else None
    if got != want:
        raise ValueError(f"DFLASH fc.weight shape mismatch: checkpoint has {got}, expected {want}.")
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
