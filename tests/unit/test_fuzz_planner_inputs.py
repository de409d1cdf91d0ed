"""`ddtree plan` on impossible, absurd and malformed input (issue 23, class 4): exit 2 with one line, at
once; never an impossible configuration planned as FITS, never a traceback, a hang or a search that
grows with the input.

The models are a Qwen3.6-27B-shaped `model_files.py describe` table (header-only checkpoint,
tests/fixtures_models.py), changed one field at a time.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ddtree_runtime.cli import main as ddtree_main
from tests.fixtures_models import write_full_checkpoint_pair

REPO = Path(__file__).resolve().parents[2]
H200 = "0, NVIDIA H200, 143771, 143156, 615"


@pytest.fixture(scope="module")
def description(tmp_path_factory) -> dict[str, Any]:
    target, draft = write_full_checkpoint_pair(tmp_path_factory.mktemp("qwen36"), "qwen3.6-27b")
    script = REPO / "ddtree_runtime/core/model_files.py"
    out = subprocess.run(
        [sys.executable, str(script), "describe", str(target), str(draft)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


def _with(doc: dict[str, Any], side: str, key: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    config = doc[side]["config"]
    (config.get("text_config", config) if side == "target" else config)[key] = value
    return doc


def _first_tensor(doc: dict[str, Any], shape: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    name = next(iter(doc["target"]["tensors"]))
    doc["target"]["tensors"][name]["shape"] = shape
    return doc


def _plan(tmp_path: Path, models: dict[str, Any], *args: str, capsys) -> tuple[int, str, str]:
    path = tmp_path / "models.json"
    path.write_text(json.dumps(models))
    started = time.monotonic()
    code = ddtree_main(["plan", "--json", "--models-json", str(path), *args])
    assert time.monotonic() - started < 10, "a bounded search"
    out = capsys.readouterr()
    return code, out.out, out.err


MODEL_CASES = {
    "negative context in the config": ("target", "max_position_embeddings", -5, "max_position_embeddings"),
    "context as a word": ("target", "max_position_embeddings", "long", "max_position_embeddings"),
    "1e9 layers": ("target", "num_hidden_layers", 10**9, "num_hidden_layers"),
    "zero heads": ("target", "num_attention_heads", 0, "num_attention_heads"),
    "a float head count": ("target", "num_key_value_heads", 4.5, "num_key_value_heads"),
    "a drafter block of 1e9": ("draft", "block_size", 10**9, "block_size"),
    "GDN heads of 1e9": ("target", "linear_num_value_heads", 10**9, "linear_num_value_heads"),
}


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_impossible_or_absurd_model_configs_are_refused(description, tmp_path, capsys, case):
    side, key, value, named = MODEL_CASES[case]
    code, out, err = _plan(
        tmp_path,
        _with(description, side, key, value),
        "--flags-json",
        "{}",
        "--nvidia-smi-csv",
        H200,
        capsys=capsys,
    )
    assert code == 2 and out == "" and err.count("\n") == 1 and named in err, err


@pytest.mark.parametrize(
    ("shape", "said"),
    [
        ([-248320, 5120], "impossible shape"),
        (["a"], "impossible shape"),
        ([2] * 9, "impossible shape"),
        ([1 << 40, 1 << 40], "more than"),
        ("5120", "impossible shape"),
    ],
)
def test_impossible_tensor_shapes_are_refused(description, tmp_path, capsys, shape, said):
    code, out, err = _plan(
        tmp_path,
        _first_tensor(description, shape),
        "--profile",
        "balanced",
        "--nvidia-smi-csv",
        H200,
        capsys=capsys,
    )
    assert code == 2 and out == "" and said in err and err.count("\n") == 1, err


def test_malformed_descriptions_are_refused(description, tmp_path, capsys):
    for doc in (
        [1, 2],
        {"target": []},
        {"target": {"path": "x", "config": [], "tensors": {}}, "draft": {}},
        {**description, "target": {**description["target"], "tensors": [1]}},
    ):
        code, out, err = _plan(
            tmp_path, doc, "--profile", "balanced", "--nvidia-smi-csv", H200, capsys=capsys
        )
        assert code == 2 and out == "" and err.count("\n") == 1, (doc, err)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--", "--speculative-ddtree-budget", "100000000"], "budget must be in 1..1023"),
        (["--", "--max-running-requests", "2000000"], "max-running-requests must be in 1..65536"),
        (["--tp-size", "1000000000"], "tp-size must be in 1..64"),
        (["--", "--context-length", "-5"], "context-length must be in"),
        (["--", "--context-length", "1000000000000"], "context-length must be in 1..67108864"),
        (["--", "--mem-fraction-static", "nan"], "mem-fraction-static must be between 0 and 1"),
        (["--", "--mamba-full-memory-ratio", "inf"], "mamba-full-memory-ratio"),
        (["--", "--page-size", "1e9"], "takes a number"),
        (["--", "--log-level info ExecStart"], "one flag and one value"),
        (["--gpus", "1000000000xH200"], "cannot read GPUs"),
        (["--gpus-json", '[{"name": "NVIDIA H200", "count": 1000000000}]'], "count of 'NVIDIA H200'"),
        (["--gpus-json", '[{"name": "NVIDIA H200", "count": "two"}]'], "count of 'NVIDIA H200'"),
        (["--gpus-json", '[{"name": "NVIDIA H200", "memory_free_mib": -1}]'], "memory_free_mib"),
        (["--gpus-json", "[1]"], "need a name"),
        (["--gpus-json", '"x"'], "must be a JSON list or dict"),
        (["--gpus-json", "[" * 100000], "not JSON"),
        (["--nvidia-smi-csv", "zero, NVIDIA H200, 143771, 143000, 0"], "GPU index that is not one"),
        (["--nvidia-smi-csv", f"{H200}\n{H200}"], "lists GPU 0 twice"),
        (["--nvidia-smi-csv", "0, NVIDIA H200, 100, 143000, 0"], "free must be between 0 and the total"),
        (["--nvidia-smi-csv", "0, NVIDIA H200, lots, 143000, 0"], "not a number"),
        (["--nvidia-smi-csv", H200, "--visible-devices", "0,0"], "name a GPU twice"),
        (["--nvidia-smi-csv", H200, "--visible-devices", "0;rm"], "GPU indices like 0,1"),
        (["--flags-json", "[1]"], "must be a JSON dict"),
    ],
)
def test_absurd_flags_and_gpu_facts_are_refused(description, tmp_path, capsys, args, said):
    base = ["--profile", "balanced"] if "--flags-json" not in args else []
    gpus = [] if any(a.startswith(("--gpus", "--nvidia")) for a in args) else ["--nvidia-smi-csv", H200]
    code, out, err = _plan(tmp_path, description, *base, *gpus, *args, capsys=capsys)
    assert code == 2 and out == "" and said in err and err.count("\n") == 1, err


def test_both_ranks_on_one_gpu_is_never_planned_as_fitting(description, tmp_path, capsys):
    two = f"{H200}\n1, NVIDIA H200, 143771, 143156, 615"
    code, _, err = _plan(
        tmp_path,
        description,
        "--profile",
        "balanced-tp2",
        "--nvidia-smi-csv",
        two,
        "--visible-devices",
        "1,1",
        capsys=capsys,
    )
    assert code == 2 and "twice" in err


def test_a_flag_written_with_a_space_is_read_as_the_roles_pass_it(description, tmp_path, capsys):
    """`sglang_extra_flags: ["--context-length 1000000"]` reaches the plan as one word: it must count."""
    code, out, _ = _plan(
        tmp_path,
        description,
        "--profile",
        "balanced",
        "--nvidia-smi-csv",
        H200,
        "--",
        "--context-length 1000000",
        capsys=capsys,
    )
    plan = json.loads(out)
    assert plan["resolved"]["context_length"] == 1000000 and plan["verdict"]["status"] != "fits"
    assert code == 1


def test_the_fixes_search_stays_short_at_the_top_of_the_range(description, tmp_path, capsys):
    """65536 running requests on one A6000: the search for the largest count that fits bisects."""
    code, out, _ = _plan(
        tmp_path,
        description,
        "--profile",
        "balanced",
        "--gpus",
        "2xA6000",
        "--",
        "--max-running-requests",
        "65536",
        "--tp-size",
        "2",
        capsys=capsys,
    )
    assert code == 1
    summaries = [c["summary"] for c in json.loads(out)["changes"]]
    assert any(s.startswith("max-running-requests 65536 -> ") for s in summaries), summaries


@pytest.mark.parametrize("where", ["--models-json", "--nvidia-smi", "--profiles"])
def test_a_fifo_or_a_device_in_place_of_a_file_is_refused_not_waited_on(description, tmp_path, where):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    models = tmp_path / "models.json"
    models.write_text(json.dumps(description))
    args = {
        "--models-json": ["--models-json", str(fifo), "--gpus", "1xH200", "--profile", "balanced"],
        "--nvidia-smi": ["--models-json", str(models), "--nvidia-smi", str(fifo), "--profile", "balanced"],
        "--profiles": [
            "--models-json",
            str(models),
            "--gpus",
            "1xH200",
            "--profile",
            "balanced",
            "--profiles",
            "/dev/zero",
        ],
    }[where]
    res = subprocess.run(
        [sys.executable, "-m", "ddtree_runtime", "plan", *args], capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 2 and "not a regular file" in res.stderr and "Traceback" not in res.stderr
