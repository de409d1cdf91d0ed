"""`ddtree tree demo` and `ddtree contract check` through their argparse registration."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from ddtree_runtime import tree_cli
from tests.fixtures_models import write_pair


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ddtree")
    tree_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_demo_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["tree", "demo"]) == 0
    out = capsys.readouterr().out
    assert "budget B=12" in out and "(root)" in out and "greedy walk: accepted nodes 0" in out
    # one table line per node after the header and the root
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if "(root)" in line)
    assert len([line for line in lines[start + 1 :] if line[:4].strip().isdigit()]) == 12


def test_demo_json_is_a_consistent_tree(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["tree", "demo", "--json", "--budget", "9", "--horizon", "4", "--seed", "3"]) == 0
    data = json.loads(capsys.readouterr().out)
    nodes = data["nodes"]
    assert data["num_nodes"] == len(nodes) == 9
    assert all(n["parent"] < n["index"] for n in nodes)
    scores = [n["score"] for n in nodes]
    assert scores == sorted(scores, reverse=True)
    acc = data["accepted"]
    assert acc[0] == 0 and len(data["emitted"]) == len(acc) == data["acceptance_length"]
    by_index = {n["index"]: n for n in nodes}
    assert [by_index[a]["token"] for a in acc[1:]] + [data["bonus"]] == data["emitted"]


def test_demo_chain(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["tree", "demo", "--json", "--topk-cap", "1", "--budget", "8", "--horizon", "5"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_nodes"] == 5 and [n["parent"] for n in data["nodes"]] == [0, 1, 2, 3, 4]


def test_demo_bad_args(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["tree", "demo", "--vocab", "1"]) == 2
    assert "--vocab >= 2" in capsys.readouterr().err


def test_bench_prints_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "tree",
        "bench",
        "--batch",
        "1,2",
        "--budget",
        "4",
        "--vocab",
        "50",
        "--horizon",
        "3",
        "--repeats",
        "1",
    ]
    assert _run(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["b"], r["B"], r["device"]) for r in rows] == [(1, 4, "cpu"), (2, 4, "cpu")]
    assert all(r["plain_build_ms"] > 0 and r["plain_walk_greedy_ms"] > 0 for r in rows)
    assert _run(["tree", "bench", "--batch", "x"]) == 2


def test_contract_check_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target, draft = write_pair(tmp_path, "qwen3.6-27b")
    assert _run(["contract", "check", "--model-path", str(target), "--draft-model-path", str(draft)]) == 0
    out = capsys.readouterr().out
    assert "capture width 25600 = 5 x 5120 == drafter fc in_features 25600: ok" in out and "hybrid" in out
    assert (
        _run(["contract", "check", "--model-path", str(target), "--draft-model-path", str(draft), "--json"])
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is True and data["contract"]["capture_width"] == 25600


def test_contract_check_mismatch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target, draft = write_pair(tmp_path, "qwen3.6-27b", fc_shape=(5120, 5120))
    argv = ["contract", "check", "--model-path", str(target), "--draft-model-path", str(draft)]
    assert _run(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("contract check failed (fc_width_mismatch): drafter fc expects [N, 5120]")
    assert "Traceback" not in err
    assert _run([*argv, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data == {
        "ok": False,
        "cause": "fc_width_mismatch",
        "message": data["message"],
        "details": {"expected": 5120, "capture_width": 25600},
    }


def test_contract_check_missing_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["contract", "check", "--model-path", str(tmp_path / "x"), "--draft-model-path", str(tmp_path)]
    assert _run(argv) == 1
    assert "(bad_config)" in capsys.readouterr().err


def test_verbs_are_wired_into_the_ddtree_cli() -> None:
    from ddtree_runtime.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["tree", "demo"]).func is tree_cli._demo
    args = parser.parse_args(["contract", "check", "--model-path", "t", "--draft-model-path", "d"])
    assert args.func is tree_cli._contract_check
