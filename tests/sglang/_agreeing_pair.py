"""A target and a DFlash drafter that agree on every token, made from the lab pair's checkpoints.

Both models' layers are silenced (``o_proj`` and ``down_proj`` zero: every layer adds nothing to the
residual stream), every embedding row gets +1 in one channel, the final norms keep only that channel
and the LM head (the drafter borrows the target's) maps it to one word. Whatever the context, the target
then continues with that word and the drafter proposes it at every depth with probability ~0.99:
each DDTREE round can accept its tree's whole depth. The configs stay the lab pair's (same widths,
same handshake).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CHANNEL = 0
LOGIT = 10.0
SILENCED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def _agree(tensors: dict[str, torch.Tensor], word_id: int, *, has_head: bool) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        t = t.clone()
        if name.endswith(SILENCED):
            t.zero_()
        elif name.endswith("embed_tokens.weight"):
            t[:, CHANNEL] = 1.0
        elif name in ("model.norm.weight", "norm.weight"):
            t.zero_()
            t[CHANNEL] = 1.0
        elif has_head and name == "lm_head.weight":
            t.zero_()
            t[word_id, CHANNEL] = LOGIT
        out[name] = t.contiguous()
    return out


def write_agreeing_pair(lab_models: Path, out: Path, word_id: int) -> tuple[Path, Path]:
    target, draft = out / "target", out / "draft"
    for src, dst, has_head in ((lab_models / "target", target, True), (lab_models / "draft", draft, False)):
        shutil.copytree(src, dst, dirs_exist_ok=True)
        weights = dst / "model.safetensors"
        save_file(_agree(load_file(str(weights)), word_id, has_head=has_head), str(weights),
                  metadata={"format": "pt"})
    return target, draft
