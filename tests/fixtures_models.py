"""Write model directories shaped like real target/drafter pairs (config.json + safetensors).

Two kinds of drafter weights:

* ``write_real_safetensors``: a real safetensors file written by the ``safetensors`` library
  (small shapes, real data), for tests that may load tensors.
* ``write_header_only_safetensors``: a valid safetensors header stating any shape (e.g. the
  27B drafter's ``fc.weight`` [5120, 25600]) with consistent ``data_offsets`` but NO data bytes.
  ``ddtree_runtime.contract`` reads headers only, so it accepts these; anything that loads the
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
    "text_config": {
        "model_type": "qwen3_5_text",
        "hidden_size": 5120,
        "num_hidden_layers": 64,
        "full_attention_interval": 4,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16,
        "vocab_size": 248320,
    },
    "vision_config": {"hidden_size": 1152},
}
QWEN36_27B_DRAFT: dict[str, Any] = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 5120,
    "num_hidden_layers": 5,
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
    "vocab_size": 151936,
}
QWEN3_8B_DRAFT: dict[str, Any] = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "num_hidden_layers": 5,
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
