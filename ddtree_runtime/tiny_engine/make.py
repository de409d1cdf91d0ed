"""`ddtree tiny-engine make-models DIR [--kind dense|hybrid]`: train the lab target, distil the drafter on
it, write real checkpoints.

Two pairs: ``dense`` (a Qwen3-style target) and ``hybrid`` (Qwen3.5's pattern: three Gated DeltaNet layers,
then one attention layer), each with a DFlash drafter distilled on its own target. Deterministic: every
random draw comes from seeded generators and training runs on one thread, so the same seed gives the same
bytes. Writes DIR/target, DIR/draft and DIR/draft-mismatched (a drafter made for a target of another width,
for fault tests), each config.json + model.safetensors like the real checkpoints.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ddtree_runtime.tiny_engine.hf_tokenizer import save_hf_tokenizer
from ddtree_runtime.tiny_engine.language import TinyLanguage
from ddtree_runtime.tiny_engine.model_config import DraftConfig, TargetConfig
from ddtree_runtime.tiny_engine.models import DraftModel, TargetModel, causal_mask, init_weights
from ddtree_runtime.tiny_engine.tokenizer import EOS_TOKEN_ID, MASK_TOKEN_ID, VOCAB_SIZE, TinyTokenizer

TARGET_CONFIG = TargetConfig(vocab_size=VOCAB_SIZE)
# Qwen3.5's hybrid pattern (full_attention_interval 4): layers 0-2 Gated DeltaNet, layer 3 attention.
HYBRID_TARGET_CONFIG = TargetConfig(
    vocab_size=VOCAB_SIZE, layer_types=("linear_attention",) * 3 + ("full_attention",)
)
TARGET_CONFIGS = {"dense": TARGET_CONFIG, "hybrid": HYBRID_TARGET_CONFIG}
TARGET_LAYER_IDS = (1, 2)
DRAFT_CONFIG = DraftConfig(
    vocab_size=VOCAB_SIZE,
    target_layer_ids=TARGET_LAYER_IDS,
    num_target_layers=TARGET_CONFIG.num_hidden_layers,
    mask_token_id=MASK_TOKEN_ID,
    hidden_size=TARGET_CONFIG.hidden_size,
)
# A drafter made for a wider target (96 instead of 64): fc is [96, 2*96]; the contract must refuse it.
MISMATCHED_TARGET_HIDDEN = 96
MISMATCHED_DRAFT_CONFIG = DraftConfig(
    vocab_size=VOCAB_SIZE,
    target_layer_ids=TARGET_LAYER_IDS,
    num_target_layers=TARGET_CONFIG.num_hidden_layers,
    mask_token_id=MASK_TOKEN_ID,
    hidden_size=MISMATCHED_TARGET_HIDDEN,
    num_attention_heads=4,
    head_dim=24,
)

DEPTH_DECAY = 7.0  # DFlash's loss weight exp(-(d-1)/gamma) per block depth


def _train_target(model: TargetModel, lang: TinyLanguage, rng: random.Random, steps: int) -> float:
    batch, seq = 32, 40
    data = torch.tensor([lang.sample(seq + 1, rng, chat=i % 5 == 0) for i in range(batch * steps)])
    opt = torch.optim.AdamW(model.parameters(), lr=4e-3, betas=(0.9, 0.95), weight_decay=0.0)
    allowed = causal_mask(seq)[None].expand(batch, -1, -1)
    positions = torch.arange(seq)[None].expand(batch, -1)
    loss = torch.tensor(0.0)
    for step in range(steps):
        chunk = data[step * batch : (step + 1) * batch]
        logits, _ = model(chunk[:, :-1], positions, allowed)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


@torch.no_grad()
def _continue(model: TargetModel, prompts: torch.Tensor, new: int, sample: bool, gen: torch.Generator):
    """The target's own continuations (full recompute per step: the model is tiny)."""
    seq = prompts
    for _ in range(new):
        b, n = seq.shape
        logits, _ = model(seq, torch.arange(n)[None].expand(b, -1), causal_mask(n)[None].expand(b, -1, -1))
        last = logits[:, -1].float()
        if sample:
            nxt = torch.multinomial(torch.softmax(last, -1), 1, generator=gen)
        else:
            nxt = last.argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return seq


def _distillation_set(target: TargetModel, lang: TinyLanguage, rng: random.Random, gen: torch.Generator):
    """(tokens [N, T], features [N, T, k*H], prompt_len) groups of the target's greedy and sampled outputs."""
    groups = []
    for plen, sample in ((4, False), (7, False), (12, False), (6, True)):
        prompts = torch.tensor([lang.sample(plen, rng, chat=plen == 12 and i % 2 == 0) for i in range(64)])
        tokens = _continue(target, prompts, 40, sample, gen)
        b, n = tokens.shape
        with torch.no_grad():
            _, feats = target(
                tokens,
                torch.arange(n)[None].expand(b, -1),
                causal_mask(n)[None].expand(b, -1, -1),
                capture_layer_ids=TARGET_LAYER_IDS,
            )
        groups.append((tokens, torch.cat(feats, dim=-1), plen))
    return groups


def _train_draft(draft: DraftModel, target: TargetModel, groups, gen: torch.Generator, steps: int) -> float:
    block = draft.cfg.block_size
    weights = torch.exp(-torch.arange(block - 1, dtype=torch.float32) / DEPTH_DECAY)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    embed, lm_head = target.model.embed_tokens, target.lm_head
    loss = torch.tensor(0.0)
    for step in range(steps):
        tokens, feats, plen = groups[step % len(groups)]
        b, n = tokens.shape
        rows = torch.randint(b, (32,), generator=gen)
        starts = torch.randint(plen, n - block + 1, (32,), generator=gen)
        tok, ft = tokens[rows], feats[rows]
        positions = torch.arange(n)[None].expand(32, -1)
        context = draft.context_kv(draft.project(ft), positions)
        valid = positions < starts[:, None]
        offs = torch.arange(block)[None]
        block_ids = torch.full((32, block), MASK_TOKEN_ID)
        block_ids[:, 0] = tok.gather(1, starts[:, None])[:, 0]
        labels = tok.gather(1, starts[:, None] + offs[:, 1:])
        hidden = draft(embed(block_ids), starts[:, None] + offs, context, valid)
        logits = lm_head(hidden[:, 1:])
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        loss = (ce.view(32, block - 1) * weights).sum() / (weights.sum() * 32)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def _bf16_round(module: torch.nn.Module) -> None:
    """Checkpoints are bf16; distil against the rounded target so the drafter matches what is served."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def _write(directory: Path, module: torch.nn.Module, config: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sorted(module.state_dict().items())}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def make_models(
    out_dir: str | Path,
    *,
    seed: int = 0,
    kind: str = "dense",
    target_steps: int = 120,
    draft_steps: int = 300,
    log: Callable[[str], None] = print,
) -> dict:
    """Train and write the lab models (``kind``: dense or hybrid); returns a summary (losses, seconds,
    paths)."""
    if kind not in TARGET_CONFIGS:
        raise ValueError(f"unknown lab model kind {kind!r}; choose one of {sorted(TARGET_CONFIGS)}")
    target_config = TARGET_CONFIGS[kind]
    out = Path(out_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: identical float reductions, hence identical bytes, every run
    t0 = time.monotonic()
    try:
        tokenizer = TinyTokenizer()
        lang = TinyLanguage(tokenizer, seed=1234 + seed)
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)

        target = TargetModel(target_config)
        init_weights(target, gen)
        target_loss = _train_target(target, lang, rng, target_steps)
        _bf16_round(target)
        target.requires_grad_(False)
        seconds = time.monotonic() - t0
        log(f"{kind} target trained: {target_steps} steps, loss {target_loss:.3f} ({seconds:.1f}s)")

        groups = _distillation_set(target, lang, rng, gen)
        draft = DraftModel(DRAFT_CONFIG, TARGET_CONFIG.hidden_size)
        init_weights(draft, gen)
        draft_loss = _train_draft(draft, target, groups, gen, draft_steps)
        _bf16_round(draft)
        log(f"drafter distilled: {draft_steps} steps, loss {draft_loss:.3f} ({time.monotonic() - t0:.1f}s)")

        mismatched = DraftModel(MISMATCHED_DRAFT_CONFIG, MISMATCHED_TARGET_HIDDEN)
        init_weights(mismatched, gen)

        _write(out / "target", target, target_config.to_hf(eos_token_id=EOS_TOKEN_ID))
        tokenizer.save(out / "target")
        save_hf_tokenizer(tokenizer, out / "target")  # what a real SGLang server loads
        _write(out / "draft", draft, DRAFT_CONFIG.to_hf())
        mismatched_cfg = MISMATCHED_DRAFT_CONFIG.to_hf()
        mismatched_cfg["num_target_layers"] = TARGET_CONFIG.num_hidden_layers
        _write(out / "draft-mismatched", mismatched, mismatched_cfg)
    finally:
        torch.set_num_threads(threads)
    seconds = time.monotonic() - t0
    log(f"wrote {out}/target, {out}/draft, {out}/draft-mismatched in {seconds:.1f}s")
    return {
        "kind": kind,
        "target_loss": target_loss,
        "draft_loss": draft_loss,
        "seconds": seconds,
        "paths": {n: str(out / n) for n in ("target", "draft", "draft-mismatched")},
    }
