"""Dispatch to the CUDA kernels: shapes the build kernel cannot take fall back to the plain path."""

from __future__ import annotations

import torch

from ddtree_runtime.core import kernels, tree


def _spy_kernel(monkeypatch):
    calls = []

    def fake_kernel(draft_logits, budget, *, topk_cap=None):
        calls.append(tuple(draft_logits.shape))
        return "kernel"

    def kernel_for(name, tensor):
        return fake_kernel if name == "build_tree" else None

    monkeypatch.setattr(tree, "_kernel_for", kernel_for)
    return calls


def test_supported_shape_goes_to_the_kernel(monkeypatch):
    calls = _spy_kernel(monkeypatch)
    assert tree.build_tree(torch.randn(1, 15, 64), 8) == "kernel"
    assert calls == [(1, 15, 64)]


def test_long_horizon_falls_back_to_the_plain_path(monkeypatch):
    calls = _spy_kernel(monkeypatch)
    logits = torch.randn(2, kernels_max_horizon() + 1, 64)
    built = tree.build_tree(logits, 8)
    assert calls == []
    assert built.tokens.shape == (2, 8)
    assert int(built.num_nodes.min()) == 8


def kernels_max_horizon() -> int:
    from ddtree_runtime.core.kernels.build import MAX_HORIZON

    return MAX_HORIZON


def test_supports_build_limits():
    assert kernels.supports_build(15, 64, 248320)
    assert not kernels.supports_build(16, 64, 248320)
    assert not kernels.supports_build(15, 4096, 248320)
    assert kernels.supports_build(15, 4096, 248320, topk_cap=8)
    assert kernels.supports_build(15, 4096, 100)  # K = min(B, V)
