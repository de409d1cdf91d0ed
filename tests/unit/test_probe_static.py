"""Static probe on model directories shaped like the real 27B pair (header-only safetensors)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ddtree_runtime.health.probe_report import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_PASS
from ddtree_runtime.health.probe_static import static_probe
from tests.fixtures_models import write_pair


def test_matching_pair_passes_with_expected_handshake(tmp_path: Path):
    target, draft = write_pair(tmp_path, "qwen3.6-27b")
    report = static_probe(str(target), str(draft))
    assert report.ok and report.exit_code == EXIT_PASS, report.message
    assert report.handshake["expected_hidden_width"] == 25600
    assert report.handshake["draft_fc_in_features"] == 25600
    assert report.handshake["target_layer_ids"] == [1, 16, 31, 46, 61]
    assert report.figures["hybrid"] is True
    assert "capture width 25600" in report.message and "hybrid" in report.message


def test_width_mismatch_is_named_with_both_numbers(tmp_path: Path):
    # a drafter trained on one layer's width: [N, 5120] where the target captures [N, 25600]
    target, draft = write_pair(tmp_path, "qwen3.6-27b", fc_shape=(5120, 5120))
    report = static_probe(str(target), str(draft))
    assert (report.ok, report.exit_code, report.cause) == (False, EXIT_FAILED, "hidden_width_mismatch")
    assert "[N, 25600]" in report.message and "[N, 5120]" in report.message


def test_contract_errors_pass_their_cause_through(tmp_path: Path):
    target, draft = write_pair(tmp_path, "qwen3-8b",
                               draft_overrides={"dflash_config": {"target_layer_ids": [1, 40]}})
    report = static_probe(str(target), str(draft))
    assert report.cause == "layer_ids_out_of_range" and report.exit_code == EXIT_FAILED
    assert "40" in report.checks[0].detail


def test_missing_directory_is_bad_input(tmp_path: Path):
    target, _ = write_pair(tmp_path, "qwen3-8b")
    report = static_probe(str(target), str(tmp_path / "nope"))
    assert (report.exit_code, report.cause) == (EXIT_BAD_INPUT, "bad_input")
    assert "--draft-model-path" in report.message


def test_cli_json_and_exit_codes(tmp_path: Path):
    target, draft = write_pair(tmp_path, "qwen3-8b")
    out = tmp_path / "static.json"
    cmd = [sys.executable, "-m", "ddtree_runtime", "probe", "static", "--model-path", str(target),
           "--draft-model-path", str(draft), "--json", "--write-report", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == EXIT_PASS, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc == json.loads(out.read_text())
    assert doc["probe"] == "static" and doc["handshake"]["expected_hidden_width"] == 20480
    assert doc["figures"]["probe_seconds"] >= 0

    bad_target, bad_draft = write_pair(tmp_path / "bad", "qwen3-8b", fc_shape=(4096, 4096))
    cmd[cmd.index(str(target))] = str(bad_target)
    cmd[cmd.index(str(draft))] = str(bad_draft)
    res = subprocess.run(cmd[:-3], capture_output=True, text=True, timeout=60)
    assert res.returncode == EXIT_FAILED
    assert "FAIL [hidden_width_mismatch]" in res.stdout
