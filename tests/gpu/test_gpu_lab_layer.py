"""The GPU lab layer's stand-ins against SGLang's own plain references on the H200 (the CPU twin is
tests/sglang/test_gpu_lab_layer.py). Runs in the GPU lab (``device.sh pytest tests/gpu``).

These checks import SGLang, and SGLang imports torchvision (through transformers). In the device's pytest
process that import once aborted the whole process with a fatal error loading torchvision's compiled
extension, so none of tests/gpu ran (issue 31). Each check therefore runs in a child interpreter of its
own, started as the lab's servers are (``DDTREE_SGLANG_GPU_LAB=1``: the lab layer boots first): a crash
there fails this one test with the child's output, and the rest of the suite runs in the one process.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        importlib.util.find_spec("ddtree_sglang_gpu_lab") is None, reason="runs in the GPU lab"
    ),
]

ROOT = Path(__file__).resolve().parents[2]


def _in_a_child(check: str) -> None:
    from ddtree_sglang_gpu_lab.server import LAB_ENV

    code = f"from tests._gpu_lab_checks import {check}; {check}('cuda')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **LAB_ENV},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{check} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}"


def test_the_standin_norms_compute_what_sglangs_native_norms_compute():
    _in_a_child("check_norms_match_sglangs_native")


def test_the_standin_activation_computes_what_sglangs_native_one_computes():
    _in_a_child("check_silu_and_mul_matches_sglangs_native")
