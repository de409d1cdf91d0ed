"""The GPU lab layer's stand-ins against SGLang's own plain references on the H200 (the CPU twin is
tests/sglang/test_gpu_lab_layer.py). Runs in the GPU lab (``device.sh pytest tests/gpu``)."""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        importlib.util.find_spec("ddtree_sglang_gpu_lab") is None, reason="runs in the GPU lab"
    ),
]


def test_the_standin_norms_compute_what_sglangs_native_norms_compute():
    from tests._gpu_lab_checks import check_norms_match_sglangs_native

    check_norms_match_sglangs_native("cuda")


def test_the_standin_activation_computes_what_sglangs_native_one_computes():
    from tests._gpu_lab_checks import check_silu_and_mul_matches_sglangs_native

    check_silu_and_mul_matches_sglangs_native("cuda")
