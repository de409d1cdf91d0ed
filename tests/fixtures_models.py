"""Write model directories shaped like real target/drafter pairs (config.json + safetensors).

Two kinds of drafter weights:

* ``write_real_safetensors``: a real safetensors file written by the ``safetensors`` library
  (small shapes, real data), for tests that may load tensors.
* ``write_header_only_safetensors``: a valid safetensors header stating any shape (e.g. the
  27B drafter's ``fc.weight`` [5120, 25600]) with consistent ``data_offsets`` but NO data bytes.
  ``ddtree_runtime.core.model_files`` reads headers only, so it accepts these; anything that loads the
  tensors would not. This is how the tests state real 27B shapes without writing 250 MB.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

# ddtree-algorithm.md section 1 table.
QWEN36_27B_TARGET: dict[str, Any] = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text",
        "hidden_size": 5120,
        "num_hidden_layers": 64,
        "intermediate_size": 17408,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "full_attention_interval": 4,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "vocab_size": 248320,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "dtype": "bfloat16",
    },
    "vision_config": {"hidden_size": 1152, "depth": 27, "intermediate_size": 4304, "num_heads": 16,
                      "out_hidden_size": 5120, "patch_size": 16, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "in_channels": 3},
    "dtype": "bfloat16",
}
QWEN36_27B_DRAFT: dict[str, Any] = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 5120,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 17408,
    "max_position_embeddings": 262144,
    "dtype": "bfloat16",
    "num_target_layers": 64,
    "block_size": 16,
    "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
    "sliding_window": 2048,
    "vocab_size": 248320,
    "dflash_config": {"target_layer_ids": [1, 16, 31, 46, 61], "mask_token_id": 248070},
}
QWEN3_8B_TARGET: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "intermediate_size": 12288,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "vocab_size": 151936,
    "dtype": "bfloat16",
}
QWEN3_8B_DRAFT: dict[str, Any] = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "dtype": "bfloat16",
    "num_target_layers": 36,
    "block_size": 16,
    "dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33], "mask_token_id": 151669},
}
PAIRS = {
    "qwen3.6-27b": (QWEN36_27B_TARGET, QWEN36_27B_DRAFT, (5120, 25600)),
    "qwen3-8b": (QWEN3_8B_TARGET, QWEN3_8B_DRAFT, (4096, 20480)),
}


def write_config(model_dir: Path, config: dict[str, Any]) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / "config.json"
    path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    return path


def safetensors_header_bytes(tensors: dict[str, tuple[str, list[int]]], *, nbytes: dict[str, int]) -> bytes:
    """Header bytes (length prefix + JSON) for ``name -> (dtype, shape)`` laid out back to back."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes[name]]}
        offset += nbytes[name]
    raw = json.dumps(header).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    return struct.pack("<Q", len(raw)) + raw


def write_header_only_safetensors(
    path: Path, tensors: dict[str, tuple[str, list[int]]], *, itemsize: int = 2
) -> Path:
    """A safetensors header with consistent offsets for ``tensors`` and no data (see module doc)."""
    nbytes = {name: itemsize * _numel(shape) for name, (_, shape) in tensors.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(safetensors_header_bytes(tensors, nbytes=nbytes))
    return path


def write_real_safetensors(path: Path, shapes: dict[str, list[int]]) -> Path:
    """A real safetensors file (bf16 zeros) written by the safetensors library."""
    import torch
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: torch.zeros(v, dtype=torch.bfloat16) for k, v in shapes.items()}, str(path))
    return path


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def write_pair(
    root: Path,
    name: str,
    *,
    target_overrides: dict[str, Any] | None = None,
    draft_overrides: dict[str, Any] | None = None,
    fc_shape: tuple[int, int] | None = None,
    sharded: bool = False,
) -> tuple[Path, Path]:
    """Target and drafter directories for one of :data:`PAIRS` with a header-only drafter checkpoint."""
    target_cfg, draft_cfg, default_fc = PAIRS[name]
    target_dir, draft_dir = root / f"{name}-target", root / f"{name}-draft"
    write_config(target_dir, {**target_cfg, **(target_overrides or {})})
    write_config(draft_dir, {**draft_cfg, **(draft_overrides or {})})
    out, inp = fc_shape or default_fc
    h = draft_cfg["hidden_size"]
    if sharded:
        write_header_only_safetensors(
            draft_dir / "model-00001-of-00002.safetensors", {"layers.0.mlp.up_proj.weight": ("BF16", [h, h])}
        )
        write_header_only_safetensors(
            draft_dir / "model-00002-of-00002.safetensors",
            {"fc.weight": ("BF16", [out, inp]), "norm.weight": ("BF16", [h])},
        )
        index = {
            "metadata": {"total_size": 0},
            "weight_map": {
                "layers.0.mlp.up_proj.weight": "model-00001-of-00002.safetensors",
                "fc.weight": "model-00002-of-00002.safetensors",
                "norm.weight": "model-00002-of-00002.safetensors",
            },
        }
        (draft_dir / "model.safetensors.index.json").write_text(json.dumps(index), encoding="utf-8")
    else:
        write_header_only_safetensors(
            draft_dir / "model.safetensors",
            {"fc.weight": ("BF16", [out, inp]), "hidden_norm.weight": ("BF16", [h])},
        )
    return target_dir, draft_dir


# ---------------------------------------------------------------------------------------------
# Whole checkpoints as header-only shards: every tensor of the real layouts, no data (for the planner).


def _decoder_mlp(prefix: str, hidden: int, ffn: int) -> dict[str, tuple[str, list[int]]]:
    return {
        f"{prefix}.mlp.gate_proj.weight": ("BF16", [ffn, hidden]),
        f"{prefix}.mlp.up_proj.weight": ("BF16", [ffn, hidden]),
        f"{prefix}.mlp.down_proj.weight": ("BF16", [hidden, ffn]),
        f"{prefix}.input_layernorm.weight": ("BF16", [hidden]),
        f"{prefix}.post_attention_layernorm.weight": ("BF16", [hidden]),
    }


def qwen36_27b_tensors() -> dict[str, tuple[str, list[int]]]:
    """Qwen3.6-27B's checkpoint layout (Hugging Face names): language model, vision tower, MTP head."""
    text = QWEN36_27B_TARGET["text_config"]
    h, ffn, vocab = text["hidden_size"], text["intermediate_size"], text["vocab_size"]
    heads, kv, hd = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    vh, kh, dk, dv = (text["linear_num_value_heads"], text["linear_num_key_heads"],
                      text["linear_key_head_dim"], text["linear_value_head_dim"])
    conv_dim = vh * dv + 2 * kh * dk
    lm = "model.language_model"
    t: dict[str, tuple[str, list[int]]] = {
        f"{lm}.embed_tokens.weight": ("BF16", [vocab, h]),
        f"{lm}.norm.weight": ("BF16", [h]),
        "lm_head.weight": ("BF16", [vocab, h]),
    }
    for i in range(text["num_hidden_layers"]):
        p = f"{lm}.layers.{i}"
        t.update(_decoder_mlp(p, h, ffn))
        if (i + 1) % text["full_attention_interval"] == 0:
            t.update({
                f"{p}.self_attn.q_proj.weight": ("BF16", [heads * hd * 2, h]),  # query + output gate
                f"{p}.self_attn.k_proj.weight": ("BF16", [kv * hd, h]),
                f"{p}.self_attn.v_proj.weight": ("BF16", [kv * hd, h]),
                f"{p}.self_attn.o_proj.weight": ("BF16", [h, heads * hd]),
                f"{p}.self_attn.q_norm.weight": ("BF16", [hd]),
                f"{p}.self_attn.k_norm.weight": ("BF16", [hd]),
            })
        else:
            t.update({
                f"{p}.linear_attn.in_proj_qkv.weight": ("BF16", [conv_dim, h]),
                f"{p}.linear_attn.in_proj_z.weight": ("BF16", [vh * dv, h]),
                f"{p}.linear_attn.in_proj_b.weight": ("BF16", [vh, h]),
                f"{p}.linear_attn.in_proj_a.weight": ("BF16", [vh, h]),
                f"{p}.linear_attn.conv1d.weight": ("BF16", [conv_dim, 1, text["linear_conv_kernel_dim"]]),
                f"{p}.linear_attn.A_log": ("F32", [vh]),
                f"{p}.linear_attn.dt_bias": ("BF16", [vh]),
                f"{p}.linear_attn.norm.weight": ("F32", [dv]),
                f"{p}.linear_attn.out_proj.weight": ("BF16", [h, vh * dv]),
            })
    vis = QWEN36_27B_TARGET["vision_config"]
    vhid, vffn = vis["hidden_size"], vis["intermediate_size"]
    t["model.visual.patch_embed.proj.weight"] = ("BF16", [vhid, 3, 2, 16, 16])
    t["model.visual.pos_embed.weight"] = ("BF16", [2304, vhid])
    for i in range(vis["depth"]):
        p = f"model.visual.blocks.{i}"
        t.update({
            f"{p}.attn.qkv.weight": ("BF16", [3 * vhid, vhid]), f"{p}.attn.qkv.bias": ("BF16", [3 * vhid]),
            f"{p}.attn.proj.weight": ("BF16", [vhid, vhid]), f"{p}.attn.proj.bias": ("BF16", [vhid]),
            f"{p}.mlp.linear_fc1.weight": ("BF16", [vffn, vhid]),
            f"{p}.mlp.linear_fc1.bias": ("BF16", [vffn]),
            f"{p}.mlp.linear_fc2.weight": ("BF16", [vhid, vffn]),
            f"{p}.mlp.linear_fc2.bias": ("BF16", [vhid]),
            f"{p}.norm1.weight": ("BF16", [vhid]), f"{p}.norm1.bias": ("BF16", [vhid]),
            f"{p}.norm2.weight": ("BF16", [vhid]), f"{p}.norm2.bias": ("BF16", [vhid]),
        })
    merged = vhid * 4
    t.update({
        "model.visual.merger.norm.weight": ("BF16", [vhid]),
        "model.visual.merger.norm.bias": ("BF16", [vhid]),
        "model.visual.merger.linear_fc1.weight": ("BF16", [merged, merged]),
        "model.visual.merger.linear_fc2.weight": ("BF16", [vis["out_hidden_size"], merged]),
    })
    # the MTP head (SGLang skips it unless it drafts with it)
    t.update({"mtp.fc.weight": ("BF16", [h, 2 * h]), "mtp.norm.weight": ("BF16", [h]),
              "mtp.pre_fc_norm_embedding.weight": ("BF16", [h]),
              "mtp.pre_fc_norm_hidden.weight": ("BF16", [h])})
    t.update(_decoder_mlp("mtp.layers.0", h, ffn))
    t.update({
        "mtp.layers.0.self_attn.q_proj.weight": ("BF16", [heads * hd * 2, h]),
        "mtp.layers.0.self_attn.k_proj.weight": ("BF16", [kv * hd, h]),
        "mtp.layers.0.self_attn.v_proj.weight": ("BF16", [kv * hd, h]),
        "mtp.layers.0.self_attn.o_proj.weight": ("BF16", [h, heads * hd]),
    })
    return t


def dflash_draft_tensors(draft: dict[str, Any], fc_in: int) -> dict[str, tuple[str, list[int]]]:
    """A DFlash drafter's layout (z-lab names): decoder layers, fc, norms; embedding and head are shared."""
    h, ffn = draft["hidden_size"], draft["intermediate_size"]
    heads, kv, hd = draft["num_attention_heads"], draft["num_key_value_heads"], draft["head_dim"]
    t: dict[str, tuple[str, list[int]]] = {
        "fc.weight": ("BF16", [h, fc_in]), "hidden_norm.weight": ("BF16", [h]), "norm.weight": ("BF16", [h]),
    }
    for i in range(draft["num_hidden_layers"]):
        p = f"layers.{i}"
        t.update(_decoder_mlp(p, h, ffn))
        t.update({
            f"{p}.self_attn.q_proj.weight": ("BF16", [heads * hd, h]),
            f"{p}.self_attn.k_proj.weight": ("BF16", [kv * hd, h]),
            f"{p}.self_attn.v_proj.weight": ("BF16", [kv * hd, h]),
            f"{p}.self_attn.o_proj.weight": ("BF16", [h, heads * hd]),
            f"{p}.self_attn.q_norm.weight": ("BF16", [hd]),
            f"{p}.self_attn.k_norm.weight": ("BF16", [hd]),
        })
    return t


def qwen3_8b_tensors() -> dict[str, tuple[str, list[int]]]:
    """Qwen3-8B's checkpoint layout (dense attention, untied head)."""
    c = QWEN3_8B_TARGET
    h, ffn, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    heads, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    t: dict[str, tuple[str, list[int]]] = {
        "model.embed_tokens.weight": ("BF16", [vocab, h]), "model.norm.weight": ("BF16", [h]),
        "lm_head.weight": ("BF16", [vocab, h]),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t.update(_decoder_mlp(p, h, ffn))
        t.update({
            f"{p}.self_attn.q_proj.weight": ("BF16", [heads * hd, h]),
            f"{p}.self_attn.k_proj.weight": ("BF16", [kv * hd, h]),
            f"{p}.self_attn.v_proj.weight": ("BF16", [kv * hd, h]),
            f"{p}.self_attn.o_proj.weight": ("BF16", [h, heads * hd]),
        })
    return t


def write_sharded_header_only(
    model_dir: Path, tensors: dict[str, tuple[str, list[int]]], shards: int
) -> None:
    """Header-only shards plus model.safetensors.index.json, as Hugging Face lays out big checkpoints."""
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for s in range(shards):
        part = {n: tensors[n] for n in names[s * per:(s + 1) * per]}
        if not part:
            continue
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        nbytes = {n: _numel(shape) * (4 if dtype == "F32" else 2) for n, (dtype, shape) in part.items()}
        (model_dir / fname).write_bytes(safetensors_header_bytes(part, nbytes=nbytes))
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index), encoding="utf-8")


def write_full_checkpoint_pair(
    root: Path, name: str = "qwen3.6-27b", *, shards: int = 4
) -> tuple[Path, Path]:
    """Configs plus every tensor's header (no data) for a target/drafter pair: what the planner reads."""
    target_cfg, draft_cfg, (_, fc_in) = PAIRS[name]
    target_dir, draft_dir = root / f"{name}-full-target", root / f"{name}-full-draft"
    write_config(target_dir, target_cfg)
    write_config(draft_dir, draft_cfg)
    target_tensors = qwen36_27b_tensors() if name == "qwen3.6-27b" else qwen3_8b_tensors()
    write_sharded_header_only(target_dir, target_tensors, shards)
    draft_tensors = dflash_draft_tensors(draft_cfg, fc_in)
    nbytes = {n: _numel(shape) * 2 for n, (_, shape) in draft_tensors.items()}
    (draft_dir / "model.safetensors").write_bytes(safetensors_header_bytes(draft_tensors, nbytes=nbytes))
    return target_dir, draft_dir
