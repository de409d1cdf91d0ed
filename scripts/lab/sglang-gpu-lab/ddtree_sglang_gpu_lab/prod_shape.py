"""Qwen3.6-27B's shape for ``--load-format dummy``: config files only, nothing to download.

The target is the lab hybrid target's config (the keys SGLang 0.5.23's ``qwen3_5_text`` needs, proven
on the device) with Qwen3.6-27B's geometry (``../shared/docs/hybrid-verify.md``, ddtree-algorithm.md
section 1): 64 layers, 48 Gated DeltaNet + 16 gated attention, hidden 5120, vocab 248320. The drafter
is z-lab/Qwen3.6-27B-DFlash's geometry (5 layers of hidden 5120 over 5 target layers: capture width
25600) with two stated departures: all five layers full attention (the checkpoint's first four slide
over 2048 tokens, which the lab's short prompts never reach) and the lab tokenizer's mask token. The
drafter's safetensors file is a header only (``fc.weight`` and its norm, no data): DDTREE's
hidden-state contract reads that header; ``--load-format dummy`` reads no weights. Acceptance on
random weights means nothing; time per pass does.

``write_dense8b_pair`` writes the middle shape beside it (issue 40): a dense Qwen3-8B target (36 layers,
hidden 4096, vocab 151936), the common DFlash target, where a round is short enough for host time to
show, with z-lab/Qwen3-8B-DFlash-b16's drafter geometry (5 layers of hidden 4096 over target layers
1, 9, 17, 25, 33: capture width 20480), from the lab dense pair's configs.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

# The project's one statement of Qwen3.6-27B's shape (from ddtree-algorithm.md): this case runs from the
# checkout, which device.sh puts first on PYTHONPATH.
from tests.fixtures_models import QWEN3_8B_DRAFT, QWEN3_8B_TARGET, QWEN36_27B_DRAFT, QWEN36_27B_TARGET

TARGET_GEOMETRY = (
    "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "full_attention_interval", "layer_types", "linear_conv_kernel_dim", "linear_key_head_dim",
    "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "vocab_size",
)  # fmt: skip
DRAFT_GEOMETRY = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "num_target_layers", "vocab_size",
)  # fmt: skip
TARGET = {
    **{k: QWEN36_27B_TARGET["text_config"][k] for k in TARGET_GEOMETRY},
    "attn_output_gate": True,
    "partial_rotary_factor": 0.25,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0},
    "rope_theta": 10000000.0,
}
DRAFT = {
    **{k: QWEN36_27B_DRAFT[k] for k in DRAFT_GEOMETRY},
    "layer_types": ["full_attention"] * QWEN36_27B_DRAFT["num_hidden_layers"],
    "rope_theta": 10000000.0,
}
TARGET_LAYER_IDS = QWEN36_27B_DRAFT["dflash_config"]["target_layer_ids"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def header_only_safetensors(path: Path, tensors: dict[str, list[int]]) -> None:
    """A safetensors header (bf16, consistent offsets) with no data bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors.items():
        size = 2
        for dim in shape:
            size *= dim
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def write_prod_pair(hybrid_lab_pair: Path, dest: Path) -> Path:
    """``dest/target`` and ``dest/draft`` at Qwen3.6-27B's shape, from the lab hybrid pair's configs."""
    target_dir, draft_dir = dest / "target", dest / "draft"
    target_dir.mkdir(parents=True, exist_ok=True)
    draft_dir.mkdir(parents=True, exist_ok=True)
    target = json.loads((hybrid_lab_pair / "target/config.json").read_text())
    target.update(TARGET)
    (target_dir / "config.json").write_text(json.dumps(target, indent=2))
    for name in TOKENIZER_FILES:
        if (hybrid_lab_pair / "target" / name).is_file():
            shutil.copy2(hybrid_lab_pair / "target" / name, target_dir / name)
    draft = json.loads((hybrid_lab_pair / "draft/config.json").read_text())
    draft.update(DRAFT)
    draft["dflash_config"] = {**draft["dflash_config"], "target_layer_ids": TARGET_LAYER_IDS}
    (draft_dir / "config.json").write_text(json.dumps(draft, indent=2))
    width = DRAFT["hidden_size"] * len(TARGET_LAYER_IDS)
    header_only_safetensors(
        draft_dir / "model.safetensors",
        {"fc.weight": [DRAFT["hidden_size"], width], "hidden_norm.weight": [DRAFT["hidden_size"]]},
    )
    return dest


DENSE8B_TARGET_GEOMETRY = (
    "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size",
)  # fmt: skip


def write_dense8b_pair(dense_lab_pair: Path, dest: Path) -> Path:
    """``dest/target`` and ``dest/draft`` at Qwen3-8B's shape, from the lab dense pair's configs."""
    target_dir, draft_dir = dest / "target", dest / "draft"
    target_dir.mkdir(parents=True, exist_ok=True)
    draft_dir.mkdir(parents=True, exist_ok=True)
    target = json.loads((dense_lab_pair / "target/config.json").read_text())
    target.update({k: QWEN3_8B_TARGET[k] for k in DENSE8B_TARGET_GEOMETRY})
    target.update({"rope_theta": 1000000.0, "tie_word_embeddings": False})
    (target_dir / "config.json").write_text(json.dumps(target, indent=2))
    for name in TOKENIZER_FILES:
        if (dense_lab_pair / "target" / name).is_file():
            shutil.copy2(dense_lab_pair / "target" / name, target_dir / name)
    draft = json.loads((dense_lab_pair / "draft/config.json").read_text())
    draft.update({k: QWEN3_8B_DRAFT[k] for k in DRAFT_GEOMETRY if k in QWEN3_8B_DRAFT})
    draft["vocab_size"] = QWEN3_8B_TARGET["vocab_size"]
    draft["num_target_layers"] = QWEN3_8B_TARGET["num_hidden_layers"]
    draft["layer_types"] = ["full_attention"] * QWEN3_8B_DRAFT["num_hidden_layers"]
    layer_ids = QWEN3_8B_DRAFT["dflash_config"]["target_layer_ids"]
    draft["dflash_config"] = {**draft["dflash_config"], "target_layer_ids": layer_ids}
    (draft_dir / "config.json").write_text(json.dumps(draft, indent=2))
    hidden = QWEN3_8B_DRAFT["hidden_size"]
    header_only_safetensors(
        draft_dir / "model.safetensors",
        {"fc.weight": [hidden, hidden * len(layer_ids)], "hidden_norm.weight": [hidden]},
    )
    return dest
