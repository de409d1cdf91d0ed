"""make-models writes real, deterministic checkpoints; the tokenizer round-trips; the target is varied."""

from __future__ import annotations

import hashlib
import json
from itertools import groupby
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ddtree_runtime.core.contract import load_contract
from ddtree_runtime.core.model_files import ContractError
from ddtree_runtime.tiny_engine.engine import SamplingParams, TinyEngine
from ddtree_runtime.tiny_engine.language import LAB_PROMPTS
from ddtree_runtime.tiny_engine.make import make_models
from ddtree_runtime.tiny_engine.tokenizer import EOS_TOKEN_ID, MASK_TOKEN_ID, TinyTokenizer

pytestmark = pytest.mark.usefixtures("tiny_one_thread")


def _tensors(path: Path) -> dict[str, tuple[list[int], str]]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: (list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118


def test_target_is_a_qwen3_checkpoint(models: Path) -> None:
    cfg = json.loads((models / "target" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    h, n = cfg["hidden_size"], cfg["num_hidden_layers"]
    tensors = _tensors(models / "target")
    assert tensors["model.embed_tokens.weight"] == ([cfg["vocab_size"], h], "BF16")
    assert tensors["lm_head.weight"] == ([cfg["vocab_size"], h], "BF16")
    for i in range(n):
        kv = cfg["num_key_value_heads"] * cfg["head_dim"]
        assert tensors[f"model.layers.{i}.self_attn.k_proj.weight"][0] == [kv, h]
        assert f"model.layers.{i}.self_attn.q_norm.weight" in tensors
        assert f"model.layers.{i}.mlp.gate_proj.weight" in tensors
    assert cfg["eos_token_id"] == EOS_TOKEN_ID


def test_drafter_is_laid_out_like_zlab_dflash(models: Path) -> None:
    target = json.loads((models / "target" / "config.json").read_text())
    cfg = json.loads((models / "draft" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    dflash = cfg["dflash_config"]
    assert dflash["block_size"] == 16 and dflash["mask_token_id"] == MASK_TOKEN_ID
    ids = dflash["target_layer_ids"]
    assert len(ids) >= 2 and all(0 <= i < target["num_hidden_layers"] for i in ids)
    tensors = _tensors(models / "draft")
    # fc: [H_draft, k * H_target], then hidden_norm; no embedding and no lm_head of its own.
    assert tensors["fc.weight"][0] == [cfg["hidden_size"], len(ids) * target["hidden_size"]]
    assert "hidden_norm.weight" in tensors and "norm.weight" in tensors
    assert not any("embed" in k or "lm_head" in k for k in tensors)
    contract = load_contract(models / "target", models / "draft")
    assert contract.capture_width == contract.fc_in_features == len(ids) * target["hidden_size"]


def test_mismatched_drafter_was_made_for_another_target(models: Path) -> None:
    with pytest.raises(ContractError) as err:
        load_contract(models / "target", models / "draft-mismatched")
    assert err.value.cause == "fc_width_mismatch"
    fc = _tensors(models / "draft-mismatched")["fc.weight"][0]
    good = _tensors(models / "draft")["fc.weight"][0]
    assert fc != good


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_make_models_is_byte_deterministic(tmp_path: Path) -> None:
    # Few steps keep this quick; determinism does not depend on how long training runs.
    a = make_models(tmp_path / "a", target_steps=3, draft_steps=3, log=lambda _m: None)
    b = make_models(tmp_path / "b", target_steps=3, draft_steps=3, log=lambda _m: None)
    assert a["target_loss"] == b["target_loss"]
    da, db = _digest(tmp_path / "a"), _digest(tmp_path / "b")
    assert set(da) >= {"target/model.safetensors", "draft/model.safetensors", "draft-mismatched/config.json"}
    assert da == db


def test_tokenizer_round_trips_and_keeps_words_whole() -> None:
    tok = TinyTokenizer()
    text = "the cat sees a dog. Ünïcode ✓ <|im_start|>user\nhi<|im_end|>"
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode(" cat") == [tok.token_id(" cat")]
    assert tok.encode("<|im_end|>") == [tok.token_id("<|im_end|>")]
    assert tok.decode(tok.encode("x<|im_end|>")) == "x"  # specials skipped by default
    assert max(ids) < tok.vocab_size


def test_target_greedy_output_is_varied(models: Path) -> None:
    engine = TinyEngine(models / "target")
    prompts = [engine.tokenizer.encode(p) for p in LAB_PROMPTS[:3]]
    out = engine.generate(prompts, [SamplingParams(max_new_tokens=48)] * 3)
    for r in out:
        assert len(r.output_ids) == 48
        assert len(set(r.output_ids)) >= 10, engine.tokenizer.decode(r.output_ids)
        longest_run = max(len(list(g)) for _, g in groupby(r.output_ids))
        assert longest_run <= 2
    # the language is what the target learned: next-token probabilities are spread (T > 0 branches)
    logits, _ = engine.target(
        torch.tensor([prompts[0]]),
        torch.arange(len(prompts[0]))[None],
        torch.ones(1, len(prompts[0]), len(prompts[0]), dtype=torch.bool).tril(),
    )
    top = torch.softmax(logits[0, -1], -1).topk(2).values
    assert 0.3 < float(top[0]) < 0.95 and float(top[1]) > 0.02
