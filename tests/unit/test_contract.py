"""The hidden-state contract on configs shaped like the real pairs, and every malformed input.

The 27B / 8B drafters' safetensors are header-only files (real shapes, consistent offsets, no
data): the contract reads headers only, see tests/fixtures_models.py. One test writes a small real
checkpoint with the safetensors library to show the reader agrees with it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ddtree_runtime.core.contract import HiddenContract, build_target_layer_ids, load_contract
from ddtree_runtime.core.hidden_states import check_hidden_states
from ddtree_runtime.core.model_files import ContractError
from tests.fixtures_models import (
    QWEN36_27B_DRAFT,
    safetensors_header_bytes,
    write_config,
    write_header_only_safetensors,
    write_pair,
    write_real_safetensors,
)


def _error(fn, *args, **kwargs) -> ContractError:
    with pytest.raises(ContractError) as info:
        fn(*args, **kwargs)
    exc = info.value
    assert exc.__cause__ is None, "no chained traceback from deep inside"
    return exc


# ---------------------------------------------------------------------------------------------
# The real pairs


def test_qwen36_27b_pair(tmp_path: Path) -> None:
    c = load_contract(*write_pair(tmp_path, "qwen3.6-27b"))
    assert (c.target_hidden_size, c.target_num_layers) == (5120, 64)  # nested under text_config
    assert c.target_layer_ids == (1, 16, 31, 46, 61)
    assert (c.capture_width, c.fc_in_features, c.draft_hidden_size) == (25600, 25600, 5120)
    assert (c.block_size, c.horizon, c.mask_token_id) == (16, 15, 248070)
    assert c.hybrid is True and c.warnings == ()
    d = c.to_dict()
    assert d["capture_width"] == 25600 and d["target_layer_ids"] == [1, 16, 31, 46, 61]
    json.dumps(d)


def test_qwen3_8b_pair_sharded(tmp_path: Path) -> None:
    c = load_contract(*write_pair(tmp_path, "qwen3-8b", sharded=True))
    assert (c.target_hidden_size, c.target_num_layers, c.target_layer_ids) == (4096, 36, (1, 9, 17, 25, 33))
    assert (c.capture_width, c.fc_in_features, c.mask_token_id, c.hybrid) == (20480, 20480, 151669, False)


def test_small_real_checkpoint_read_like_safetensors(tmp_path: Path) -> None:
    target, draft = tmp_path / "t", tmp_path / "d"
    write_config(target, {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 8})
    write_config(draft, {"hidden_size": 32, "num_hidden_layers": 3, "block_size": 8})
    path = write_real_safetensors(draft / "model.safetensors", {"fc.weight": [32, 192], "norm.weight": [32]})
    c = load_contract(target, draft)
    with safe_open(str(path), "pt") as fh:
        assert list(fh.get_slice("fc.weight").get_shape()) == [32, c.fc_in_features]
    assert c.target_layer_ids == (1, 3, 5) == tuple(build_target_layer_ids(8, 3))
    assert c.capture_width == 192 and c.mask_token_id is None
    assert c.warnings and "default" in c.warnings[0]


def test_default_layer_ids_match_sglang() -> None:
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(48, 5) == [1, 12, 23, 34, 45]
    assert build_target_layer_ids(10, 1) == [5]
    assert _error(build_target_layer_ids, 3, 2).cause == "bad_config"


def test_top_level_fallbacks(tmp_path: Path) -> None:
    draft_cfg = {k: v for k, v in QWEN36_27B_DRAFT.items() if k != "dflash_config"}
    draft_cfg.update(target_layer_ids=[1, 16, 31, 46, 61], mask_token_id=248070, block_size=10)
    target, draft = write_pair(tmp_path, "qwen3.6-27b")
    write_config(draft, draft_cfg)
    c = load_contract(target, draft)
    assert (c.target_layer_ids, c.block_size, c.mask_token_id) == ((1, 16, 31, 46, 61), 10, 248070)


def test_missing_layer_ids_use_default(tmp_path: Path) -> None:
    c = load_contract(*write_pair(tmp_path, "qwen3.6-27b", draft_overrides={"dflash_config": {}}))
    assert c.target_layer_ids == (1, 16, 31, 46, 61) and "SGLang's default" in c.warnings[0]


def test_num_target_layers_mismatch_is_a_warning(tmp_path: Path) -> None:
    c = load_contract(*write_pair(tmp_path, "qwen3-8b", draft_overrides={"num_target_layers": 40}))
    assert any("40-layer target" in w for w in c.warnings)


@pytest.mark.parametrize(
    ("overrides", "hybrid"),
    [
        ({"model_type": "qwen3_next", "hidden_size": 4096, "num_hidden_layers": 36}, True),
        ({"layer_types": ["full_attention", "linear_attention"] * 18}, True),
        ({"full_attention_interval": 4}, True),
        ({"model_type": "mamba2"}, True),
        ({"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h"}, True),
        ({"layer_types": ["full_attention"] * 36}, False),
    ],
)
def test_hybrid_detection(tmp_path: Path, overrides: dict, hybrid: bool) -> None:
    c = load_contract(*write_pair(tmp_path, "qwen3-8b", target_overrides=overrides))
    assert c.hybrid is hybrid


# ---------------------------------------------------------------------------------------------
# Width mismatches at load time


def test_fc_width_mismatch(tmp_path: Path) -> None:
    target, draft = write_pair(tmp_path, "qwen3.6-27b", fc_shape=(5120, 20480))
    exc = _error(load_contract, target, draft)
    assert exc.cause == "fc_width_mismatch"
    assert "[N, 20480]" in str(exc) and "[N, 25600]" in str(exc) and "5 target layers x 5120" in str(exc)
    assert "4 layers" in str(exc)
    c = load_contract(target, draft, check=False)
    assert (c.capture_width, c.fc_in_features) == (25600, 20480)


def test_fc_out_features_disagree_with_config(tmp_path: Path) -> None:
    exc = _error(load_contract, *write_pair(tmp_path, "qwen3-8b", fc_shape=(2048, 20480)))
    assert exc.cause == "fc_width_mismatch" and "2048" in str(exc) and "4096" in str(exc)


def test_drafter_for_another_target(tmp_path: Path) -> None:
    # 27B drafter against an 8B target: layer 61 does not exist in a 36-layer model
    target, _ = write_pair(tmp_path, "qwen3-8b")
    _, draft = write_pair(tmp_path, "qwen3.6-27b")
    exc = _error(load_contract, target, draft)
    assert exc.cause == "layer_ids_out_of_range" and "36 layers" in str(exc) and "[46, 61]" in str(exc)


@pytest.mark.parametrize("ids", [[1, 16, 31, 46, 64], [-1, 16, 31, 46, 61]])
def test_layer_ids_out_of_range(tmp_path: Path, ids: list[int]) -> None:
    pair = write_pair(tmp_path, "qwen3.6-27b", draft_overrides={"dflash_config": {"target_layer_ids": ids}})
    exc = _error(load_contract, *pair)
    assert exc.cause == "layer_ids_out_of_range" and "64 layers" in str(exc)


# ---------------------------------------------------------------------------------------------
# Malformed files: one clear ContractError each


def _pair(tmp_path: Path) -> tuple[Path, Path]:
    return write_pair(tmp_path, "qwen3-8b")


def test_missing_directory(tmp_path: Path) -> None:
    exc = _error(load_contract, tmp_path / "nope", tmp_path / "nope2")
    assert exc.cause == "bad_config" and "does not exist" in str(exc)


def test_missing_config(tmp_path: Path) -> None:
    target, draft = _pair(tmp_path)
    (draft / "config.json").unlink()
    exc = _error(load_contract, target, draft)
    assert exc.cause == "bad_config" and "draft config" in str(exc) and "missing" in str(exc)


@pytest.mark.parametrize(
    ("text", "needle"), [("{not json", "not valid JSON"), ("[1, 2]", "JSON object"), ("", "not valid JSON")]
)
def test_bad_json(tmp_path: Path, text: str, needle: str) -> None:
    target, draft = _pair(tmp_path)
    (target / "config.json").write_text(text)
    exc = _error(load_contract, target, draft)
    assert exc.cause == "bad_config" and needle in str(exc) and "target config" in str(exc)


@pytest.mark.parametrize(
    ("which", "config", "needle"),
    [
        ("target", {"num_hidden_layers": 36}, "hidden_size"),
        ("target", {"hidden_size": "4096", "num_hidden_layers": 36}, "hidden_size must be an integer"),
        ("target", {"hidden_size": 4096}, "num_hidden_layers"),
        ("target", {"text_config": {"hidden_size": 0}, "num_hidden_layers": 36}, "hidden_size must be"),
        ("draft", {"num_hidden_layers": 5, "block_size": 16}, "hidden_size"),
        ("draft", {"hidden_size": 4096, "num_hidden_layers": 5}, "block_size"),
        ("draft", {"hidden_size": 4096, "block_size": 16}, "neither"),
        ("draft", {"hidden_size": 4096, "block_size": 16, "dflash_config": [1]}, "dflash_config"),
        ("draft", {"hidden_size": 4096, "block_size": 16, "target_layer_ids": "1,9"}, "list of integers"),
        ("draft", {"hidden_size": 4096, "block_size": 16, "target_layer_ids": []}, "list of integers"),
        ("draft", {"hidden_size": 4096, "block_size": 16, "target_layer_ids": [1, True]}, "list of integers"),
        ("draft", {"hidden_size": 4096, "block_size": 1, "target_layer_ids": [1]}, "block_size"),
    ],
)
def test_missing_or_bad_keys(tmp_path: Path, which: str, config: dict, needle: str) -> None:
    target, draft = _pair(tmp_path)
    write_config(target if which == "target" else draft, config)
    exc = _error(load_contract, target, draft)
    assert exc.cause == "bad_config" and needle in str(exc)


def _write_raw(path: Path, data: bytes) -> None:
    for old in path.parent.glob("*.safetensors*"):
        old.unlink()
    path.write_bytes(data)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"", "truncated"),
        (b"\x10\x00", "truncated"),
        (struct.pack("<Q", 500) + b'{"fc.weight": ', "truncated"),
        (struct.pack("<Q", 200 * 1024 * 1024) + b"{}", "limit"),
        (struct.pack("<Q", 2**63) + b"{}", "limit"),
        (struct.pack("<Q", 6) + b"\xff\xfe{}{}", "not valid JSON"),
        (struct.pack("<Q", 4) + b"[12]", "JSON object"),
        (struct.pack("<Q", 2) + b"{}", "no fc.weight"),
    ],
)
def test_bad_safetensors(tmp_path: Path, data: bytes, needle: str) -> None:
    target, draft = _pair(tmp_path)
    _write_raw(draft / "model.safetensors", data)
    exc = _error(load_contract, target, draft)
    assert exc.cause == "bad_safetensors" and needle in str(exc), str(exc)


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        ({"dtype": "BF16", "shape": [4096], "data_offsets": [0, 8192]}, "shape must be [out, in]"),
        ({"dtype": "BF16", "shape": [4096, "x"], "data_offsets": [0, 1]}, "shape must be [out, in]"),
        ({"dtype": "Q4", "shape": [4096, 20480], "data_offsets": [0, 1]}, "unknown dtype"),
        ({"dtype": "BF16", "shape": [4096, 20480]}, "data_offsets"),
        ({"dtype": "BF16", "shape": [4096, 20480], "data_offsets": [0, 10]}, "do not match"),
        ("not an object", "no fc.weight"),
    ],
)
def test_bad_fc_entry(tmp_path: Path, entry, needle: str) -> None:
    target, draft = _pair(tmp_path)
    raw = json.dumps({"fc.weight": entry}).encode()
    _write_raw(draft / "model.safetensors", struct.pack("<Q", len(raw)) + raw)
    exc = _error(load_contract, target, draft)
    assert exc.cause == "bad_safetensors" and needle in str(exc), str(exc)


def test_no_weights_at_all(tmp_path: Path) -> None:
    target, draft = _pair(tmp_path)
    (draft / "model.safetensors").unlink()
    exc = _error(load_contract, target, draft)
    assert exc.cause == "bad_safetensors" and "not found" in str(exc)


def test_single_oddly_named_file_and_prefixed_key(tmp_path: Path) -> None:
    target, draft = _pair(tmp_path)
    (draft / "model.safetensors").unlink()
    write_header_only_safetensors(draft / "drafter.safetensors", {"model.fc.weight": ("BF16", [4096, 20480])})
    assert load_contract(target, draft).fc_in_features == 20480


@pytest.mark.parametrize(
    ("index", "needle"),
    [
        ("{broken", "not a valid safetensors index"),
        (json.dumps({"metadata": {}}), "no weight_map"),
        (json.dumps({"weight_map": {"norm.weight": "a.safetensors"}}), "no fc.weight"),
        (json.dumps({"weight_map": {"fc.weight": "missing.safetensors"}}), "missing"),
    ],
)
def test_bad_sharded_index(tmp_path: Path, index: str, needle: str) -> None:
    target, draft = write_pair(tmp_path, "qwen3-8b", sharded=True)
    (draft / "model.safetensors.index.json").write_text(index)
    exc = _error(load_contract, target, draft)
    assert exc.cause == "bad_safetensors" and needle in str(exc), str(exc)


def test_header_bytes_helper_pads_to_eight(tmp_path: Path) -> None:
    raw = safetensors_header_bytes({"fc.weight": ("BF16", [2, 3])}, nbytes={"fc.weight": 12})
    (length,) = struct.unpack("<Q", raw[:8])
    assert length % 8 == 0 and len(raw) == 8 + length


# ---------------------------------------------------------------------------------------------
# Live tensors


@pytest.fixture
def contract_27b() -> HiddenContract:
    return HiddenContract(
        target_hidden_size=5120,
        target_num_layers=64,
        target_layer_ids=(1, 16, 31, 46, 61),
        block_size=16,
        draft_hidden_size=5120,
        fc_in_features=25600,
        mask_token_id=248070,
        hybrid=True,
    )


def test_live_tensor_ok(contract_27b: HiddenContract) -> None:
    hidden = torch.zeros(17, 25600, dtype=torch.bfloat16)
    check_hidden_states(hidden, contract_27b)
    check_hidden_states(hidden, contract_27b, num_tokens=17, dtype=torch.bfloat16, device="cpu")
    check_hidden_states(hidden, contract_27b, dtype="bfloat16", device=torch.device("cpu"))


def test_live_tensor_only_last_layer(contract_27b: HiddenContract) -> None:
    exc = _error(check_hidden_states, torch.zeros(3, 5120), contract_27b)
    assert exc.cause == "hidden_width_mismatch"
    assert str(exc) == (
        "drafter expects [N, 25600] (5 target layers x 5120) but got [N, 5120]: the target captured no "
        "auxiliary layers; is the algorithm treated as DFlash-family?"
    )
    assert exc.details == {"expected": 25600, "observed": 5120}


def test_live_tensor_other_widths(contract_27b: HiddenContract) -> None:
    exc = _error(check_hidden_states, torch.zeros(3, 15360), contract_27b)
    assert exc.cause == "hidden_width_mismatch" and "captured 3 layers instead of 5" in str(exc)
    exc = _error(check_hidden_states, torch.zeros(3, 4096), contract_27b)
    assert "not a multiple of the target hidden size 5120" in str(exc)


def test_live_tensor_none(contract_27b: HiddenContract) -> None:
    exc = _error(check_hidden_states, None, contract_27b)
    assert exc.cause == "hidden_states_missing" and "[N, 25600]" in str(exc) and "got None" in str(exc)


def test_live_tensor_rank_tokens_dtype_device(contract_27b: HiddenContract) -> None:
    exc = _error(check_hidden_states, torch.zeros(2, 3, 25600), contract_27b)
    assert exc.cause == "hidden_width_mismatch" and "2-D" in str(exc) and "[2, 3, 25600]" in str(exc)
    exc = _error(check_hidden_states, torch.zeros(16, 25600), contract_27b, num_tokens=17)
    assert exc.cause == "hidden_width_mismatch" and "17 tokens" in str(exc) and "[16, 25600]" in str(exc)
    exc = _error(check_hidden_states, torch.zeros(4, 25600), contract_27b, dtype=torch.bfloat16)
    assert exc.cause == "hidden_dtype_mismatch" and "float32" in str(exc) and "bfloat16" in str(exc)
    exc = _error(check_hidden_states, torch.zeros(4, 25600, device="meta"), contract_27b, device="cpu")
    assert exc.cause == "hidden_device_mismatch" and "meta" in str(exc)
