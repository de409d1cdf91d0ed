"""Tiny real models for the lab: a Qwen3-style target and a DFlash-style drafter.

The target is a Qwen3 decoder (GQA, q/k RMSNorm, RoPE, SwiGLU) with HF parameter names. The drafter follows
z-lab's `DFlashDraftModel`: no embedding and no LM head of its own (it borrows the target's), context
features = target hidden states after `target_layer_ids`, concatenated and projected by `fc` + `hidden_norm`,
injected as extra K/V in every layer; attention over [context, block] is non-causal.

Both forwards take explicit rows/masks so the engine can run prefill, chain verify and tree verify with a KV
cache, batched with different lengths, through the same code the models were trained with.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn


@dataclass(frozen=True)
class TargetConfig:
    vocab_size: int
    hidden_size: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768

    def to_hf(self, *, eos_token_id: int) -> dict:
        """config.json as a Qwen3 checkpoint has it."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            **asdict(self),
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "bos_token_id": eos_token_id,
            "eos_token_id": eos_token_id,
            "use_sliding_window": False,
            "sliding_window": None,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
        }

    @classmethod
    def from_hf(cls, cfg: dict) -> TargetConfig:
        return cls(**{k: cfg[k] for k in cls.__dataclass_fields__ if k in cfg})


@dataclass(frozen=True)
class DraftConfig:
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    mask_token_id: int
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    layer_types: tuple[str, ...] = field(default=())

    def to_hf(self) -> dict:
        """config.json as z-lab's DFlash drafters have it."""
        d = asdict(self)
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": d["hidden_size"],
            "num_hidden_layers": d["num_hidden_layers"],
            "num_attention_heads": d["num_attention_heads"],
            "num_key_value_heads": d["num_key_value_heads"],
            "head_dim": d["head_dim"],
            "intermediate_size": d["intermediate_size"],
            "rms_norm_eps": d["rms_norm_eps"],
            "rope_theta": d["rope_theta"],
            "max_position_embeddings": d["max_position_embeddings"],
            "vocab_size": d["vocab_size"],
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "num_target_layers": d["num_target_layers"],
            "block_size": d["block_size"],
            "layer_types": list(self.layer_types) or ["full_attention"] * self.num_hidden_layers,
            "dflash_config": {
                "target_layer_ids": list(self.target_layer_ids),
                "block_size": self.block_size,
                "mask_token_id": self.mask_token_id,
                "mask_token": "<|MASK|>",
            },
        }

    @classmethod
    def from_hf(cls, cfg: dict) -> DraftConfig:
        dflash = cfg.get("dflash_config") or {}
        kwargs = {k: cfg[k] for k in cls.__dataclass_fields__ if k in cfg and k != "layer_types"}
        kwargs["target_layer_ids"] = tuple(dflash.get("target_layer_ids", cfg.get("target_layer_ids", ())))
        kwargs["block_size"] = int(dflash.get("block_size", cfg.get("block_size", 16)))
        kwargs["mask_token_id"] = int(dflash.get("mask_token_id", cfg.get("mask_token_id", 0)))
        kwargs["num_target_layers"] = int(cfg.get("num_target_layers", 0))
        return cls(**kwargs)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.weight


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

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def _split(self, x: Tensor, heads: int) -> Tensor:
        b, n, _ = x.shape
        return x.view(b, n, heads, self.head_dim).transpose(1, 2)

    def queries(self, x: Tensor, positions: Tensor, theta: float) -> Tensor:
        return apply_rope(self.q_norm(self._split(self.q_proj(x), self.heads)), positions, theta)

    def keys_values(self, x: Tensor, positions: Tensor, theta: float) -> tuple[Tensor, Tensor]:
        k = apply_rope(self.k_norm(self._split(self.k_proj(x), self.kv_heads)), positions, theta)
        return k, self._split(self.v_proj(x), self.kv_heads)


class DecoderLayer(nn.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim, inter, eps) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = SwiGLU(hidden, inter)


class KVCache:
    """Per-layer K/V rows [b, kv_heads, capacity, head_dim]; row i holds the token at logical position i."""

    def __init__(self, layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int, like: Tensor):
        shape = (batch, kv_heads, capacity, head_dim)
        self.k = [like.new_zeros(shape) for _ in range(layers)]
        self.v = [like.new_zeros(shape) for _ in range(layers)]
        self.capacity = capacity

    def write(self, layer: int, rows: Tensor, k: Tensor, v: Tensor) -> None:
        """rows [b, n] absolute cache rows for k/v [b, h, n, d]."""
        if int(rows.max()) >= self.capacity:
            raise RuntimeError(f"KV cache overflow: row {int(rows.max())} >= capacity {self.capacity}")
        idx = rows[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        self.k[layer].scatter_(2, idx, k)
        self.v[layer].scatter_(2, idx, v)

    def view(self, layer: int, length: int) -> tuple[Tensor, Tensor]:
        return self.k[layer][:, :, :length], self.v[layer][:, :, :length]

    def move_rows(self, src: Tensor, dst: Tensor) -> None:
        """Copy rows src -> dst per request ([b, m] absolute rows, gathered first so overlaps are safe)."""
        for store in (self.k, self.v):
            for t in store:
                idx_src = src[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
                idx_dst = dst[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
                t.scatter_(2, idx_dst, t.gather(2, idx_src))

    def select(self, keep: Tensor) -> None:
        """Keep only the requests at indices `keep` (finished ones leave the batch)."""
        self.k = [t.index_select(0, keep) for t in self.k]
        self.v = [t.index_select(0, keep) for t in self.v]

    def extend(self, other: KVCache, capacity: int) -> None:
        """Append other's requests as new rows; both grow to `capacity` rows per request."""

        def grow(t: Tensor) -> Tensor:
            return F.pad(t, (0, 0, 0, capacity - t.shape[2]))

        self.k = [torch.cat([grow(a), grow(b)]) for a, b in zip(self.k, other.k, strict=True)]
        self.v = [torch.cat([grow(a), grow(b)]) for a, b in zip(self.v, other.v, strict=True)]
        self.capacity = capacity


class TargetModel(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(
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
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        c = self.cfg
        like = self.lm_head.weight
        return KVCache(c.num_hidden_layers, batch, c.num_key_value_heads, c.head_dim, capacity, like)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        allowed: Tensor,
        *,
        cache: KVCache | None = None,
        rows: Tensor | None = None,
        capture_layer_ids: tuple[int, ...] = (),
    ) -> tuple[Tensor, list[Tensor]]:
        """input_ids/positions [b, n]. Without a cache, allowed is [b, n, n]; with one, the new K/V go to
        cache `rows` [b, n] and allowed is [b, n, S] over cache rows 0..S-1.
        Returns logits [b, n, V] and the residual stream after each layer in capture_layer_ids."""
        h = self.model.embed_tokens(input_ids)
        theta = self.cfg.rope_theta
        captured: dict[int, Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            x = layer.input_layernorm(h)
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
                p.fill_(1.0)
            else:
                std = 0.02 if "embed" in name else 1.0 / math.sqrt(p.shape[-1])
                p.copy_(torch.randn(p.shape, generator=generator) * std)


def _read_config(directory: Path) -> dict:
    path = directory / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{path} not found: run `ddtree lab make-models DIR` first") from exc


def load_target(directory: str | Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A Qwen3-style lab target from config.json + model.safetensors (strict: every tensor must fit)."""
    directory = Path(directory)
    cfg = TargetConfig.from_hf(_read_config(directory))
    model = TargetModel(cfg)
    model.load_state_dict(load_file(str(directory / "model.safetensors")), strict=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load_draft(
    directory: str | Path, target_hidden_size: int, *, device: str = "cpu", dtype: torch.dtype = torch.float32
):
    """A DFlash-style lab drafter; a checkpoint made for another target fails here like SGLang's loader."""
    directory = Path(directory)
    cfg = DraftConfig.from_hf(_read_config(directory))
    model = DraftModel(cfg, target_hidden_size)
    state = load_file(str(directory / "model.safetensors"))
    want = tuple(model.fc.weight.shape)
    got = tuple(state["fc.weight"].shape) if "fc.weight" in state else None
    if got != want:
        raise ValueError(f"DFLASH fc.weight shape mismatch: checkpoint has {got}, expected {want}.")
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
