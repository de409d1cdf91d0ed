"""The GPU lab layer's stand-ins against SGLang's own plain references, on any device: run on CPU by
tests/sglang/test_gpu_lab_layer.py and on the H200 by tests/gpu/test_gpu_lab_layer.py (they decide what
the served model's norms and activations compute)."""

from __future__ import annotations

import torch


def _inputs(device: str, rows: int = 5, width: int = 64, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(rows, width, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    weight = (torch.randn(width, generator=gen) * 0.5).to(device, torch.bfloat16)
    return x, residual, weight


def check_norms_match_sglangs_native(device: str) -> None:
    from ddtree_sglang_gpu_lab import sgl_kernel_standin as standin
    from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm

    x, residual, weight = _inputs(device)
    for cls, plain, fused in (
        (RMSNorm, standin.rmsnorm, standin.fused_add_rmsnorm),
        (GemmaRMSNorm, standin.gemma_rmsnorm, standin.gemma_fused_add_rmsnorm),
    ):
        norm = cls(x.shape[-1], eps=1e-6).to(device, torch.bfloat16)
        norm.weight.data.copy_(weight)
        ref = norm.forward_native(x.clone())
        got = plain(x.clone(), norm.weight.data, 1e-6)
        assert torch.equal(got, ref), (cls.__name__, (got.float() - ref.float()).abs().max())
        out = torch.empty_like(x)
        assert plain(x.clone(), norm.weight.data, 1e-6, out=out) is out and torch.equal(out, ref)
        ref_x, ref_res = norm.forward_native(x.clone(), residual.clone())
        got_x, got_res = x.clone(), residual.clone()
        assert fused(got_x, got_res, norm.weight.data, 1e-6) is None  # in place, as the kernel
        assert torch.equal(got_res, ref_res), cls.__name__
        assert torch.equal(got_x, ref_x), (cls.__name__, (got_x.float() - ref_x.float()).abs().max())


def check_silu_and_mul_matches_sglangs_native(device: str) -> None:
    from ddtree_sglang_gpu_lab import sgl_kernel_standin as standin
    from sglang.srt.layers.activation import SiluAndMul

    x, _, _ = _inputs(device, width=96)
    ref = SiluAndMul().forward_native(x)
    out = torch.empty_like(ref)
    standin.silu_and_mul(x, out)
    assert torch.allclose(out.float(), ref.float(), atol=1e-2, rtol=1e-2), (
        (out.float() - ref.float()).abs().max()
    )
