"""The tiny models' ``config.json``, both ways: what a Qwen3 (dense) or Qwen3.5 text (hybrid) checkpoint and a
z-lab DFlash drafter hold, as the configs ``models`` builds the networks from. Read by ``make`` (which writes
them), ``models`` (which loads a checkpoint) and the benchmark (which names the pair)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


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
    # hybrid targets (Qwen3.5 pattern): "linear_attention" layers are Gated DeltaNet
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4

    @property
    def is_hybrid(self) -> bool:
        return "linear_attention" in self.layer_types

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full_attention"

    def to_hf(self, *, eos_token_id: int) -> dict:
        """config.json as a Qwen3 (dense) or Qwen3.5 text (hybrid) checkpoint has it."""
        base = {k: v for k, v in asdict(self).items() if k != "layer_types" and not k.startswith("linear_")}
        out = {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            **base,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "bos_token_id": eos_token_id,
            "eos_token_id": eos_token_id,
            "use_sliding_window": False,
            "sliding_window": None,
            "layer_types": [self.layer_type(i) for i in range(self.num_hidden_layers)],
        }
        if self.is_hybrid:
            full = [i for i in range(self.num_hidden_layers) if self.layer_type(i) == "full_attention"]
            out.update(
                architectures=["Qwen3_5ForCausalLM"],
                model_type="qwen3_5_text",
                full_attention_interval=full[0] + 1 if full else 0,
                # What the lab's attention layers are, in the keys SGLang's Qwen3.5 class reads (its
                # defaults are Qwen3.6's: a gated output and RoPE on a quarter of each head).
                attn_output_gate=False,
                partial_rotary_factor=1.0,
                rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
                mamba_ssm_dtype="float32",
                **{k: v for k, v in asdict(self).items() if k.startswith("linear_")},
            )
        return out

    @classmethod
    def from_hf(cls, cfg: dict) -> TargetConfig:
        kwargs = {k: cfg[k] for k in cls.__dataclass_fields__ if k in cfg}
        kwargs["layer_types"] = tuple(cfg.get("layer_types") or ())
        return cls(**kwargs)


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



def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{path} not found: run `ddtree tiny-engine make-models DIR` first") from exc


def load_target_config(directory: str | Path) -> TargetConfig:
    return TargetConfig.from_hf(read_config(Path(directory)))

