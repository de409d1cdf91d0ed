"""SGLang's own Triton tree-verify kernel (``verify_tree_greedy_triton``, interpreted on CPU) fed
with DDTREE's tree arrays accepts exactly the path our walk accepts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kernel_cases() -> list[dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "DDTREE_DISABLE_KERNELS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.sglang._tree_kernel_parity"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_all_cases_ran(kernel_cases):
    assert len(kernel_cases) == 6


def test_kernel_accepts_the_same_path_as_our_walk(kernel_cases):
    for case in kernel_cases:
        assert case["sglang_accept_index"] == case["ours_accept_index"], case
        assert case["sglang_accept_length"] == case["ours_accept_length"], case
        assert case["sglang_bonus"] == case["ours_bonus"], case


def test_cases_cover_rejection_and_deep_acceptance(kernel_cases):
    lengths = [n for case in kernel_cases for n in case["ours_accept_length"]]
    assert min(lengths) == 0
    assert max(lengths) >= 3
