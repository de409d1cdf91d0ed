"""Stands in for ``sgl-kernel`` (the CUDA kernel package a GPU host installs beside SGLang).

SGLang limitation: on CUDA, module import does ``from sgl_kernel import ...`` (norms, activations,
rope, sampling, MoE, quantisation: ``srt/layers/layernorm.py`` ~102, ``activation.py`` ~60,
``sampler.py`` ~40, ...), so without the package no server starts. The package is 300+ MB of
compiled kernels for every architecture and does not travel to the device.

The stand-in is a package whose every name resolves (an op nobody implemented raises when called,
naming itself), with plain-torch versions of the ops the lab's path calls:

* ``rmsnorm`` / ``fused_add_rmsnorm`` / ``gemma_rmsnorm`` / ``gemma_fused_add_rmsnorm``: what
  ``RMSNorm.forward_native`` / ``GemmaRMSNorm.forward_native`` compute (fp32 math, one cast; the residual
  sum in fp32 for RMSNorm, in the input dtype for GemmaRMSNorm, as each does);
  ``fused_add_rmsnorm`` writes ``residual += x`` and ``x = norm(residual)`` in place, as the kernel does;
* ``silu_and_mul``: SGLang's run-time compiled kernel serves aligned widths, this one the rest;
* ``weak_ref_tensor``: the breakable prefill graph keeps a reference to its outputs; the tensor itself
  (a strong reference) keeps them alive a little longer, no more;
* ``utils.is_arch_support_pdl``: False (no programmatic dependent launch in these plain ops).

The norms decide what the model computes, so ``tests/gpu/test_gpu_lab_layer.py`` checks them against
SGLang's own ``forward_native`` on the GPU. Installed only when no real ``sgl_kernel`` is importable.
The stand-in mechanism is the base's (``ddtree_sglang_lab_base.standin``), shared with the CPU
layer; the ops are this layer's.
"""

from __future__ import annotations

from typing import Any

import torch
from ddtree_sglang_lab_base.standin import MissingOp as MissingOp  # raised by the ops
from ddtree_sglang_lab_base.standin import StandinPackage

from ddtree_sglang_gpu_lab import seams

NAME = "sgl_kernel"
VERSION = "0.0.0+ddtree-gpu-lab-standin"
# Every submodule resolves (CUDA imports such as ``gguf.py``'s ``sgl_kernel.quantization`` are not
# guarded), except these, whose ImportError SGLang answers with a fallback of its own
# (``layers/quantization/utils.py`` ~11: ``scalar_type``).
UNIMPORTABLE = ("scalar_type",)


def _normalize(x: torch.Tensor, weight: torch.Tensor, eps: float, *, gemma: bool) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    w = weight.float()
    return (xf * (1.0 + w if gemma else w)).to(x.dtype)


def rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    result = _normalize(input, weight, eps, gemma=False)
    if out is None:
        return result
    out.copy_(result)
    return out


def gemma_rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    result = _normalize(input, weight, eps, gemma=True)
    if out is None:
        return result
    out.copy_(result)
    return out


def _fused_add(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool
) -> None:
    # As each class's forward_native adds: RMSNorm in fp32, GemmaRMSNorm in the input dtype.
    summed = (input + residual).float() if gemma else input.float() + residual.float()
    residual.copy_(summed)
    xf = summed * torch.rsqrt(summed.pow(2).mean(dim=-1, keepdim=True) + eps)
    w = weight.float()
    input.copy_(xf * (1.0 + w if gemma else w))


def fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    _fused_add(input, residual, weight, eps, gemma=False)


def gemma_fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    _fused_add(input, residual, weight, eps, gemma=True)


def silu_and_mul(
    input: torch.Tensor, out: torch.Tensor | None = None, enable_pdl: bool | None = None
) -> torch.Tensor:
    d = input.shape[-1] // 2
    result = (torch.nn.functional.silu(input[..., :d].float()) * input[..., d:].float()).to(input.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def weak_ref_tensor(tensor: Any) -> Any:
    return tensor


def is_arch_support_pdl() -> bool:
    return False


IMPLEMENTED = {
    "rmsnorm": rmsnorm,
    "fused_add_rmsnorm": fused_add_rmsnorm,
    "gemma_rmsnorm": gemma_rmsnorm,
    "gemma_fused_add_rmsnorm": gemma_fused_add_rmsnorm,
    "silu_and_mul": silu_and_mul,
    "weak_ref_tensor": weak_ref_tensor,
    "utils.is_arch_support_pdl": is_arch_support_pdl,
}


# SGLang's callers of the implemented ops (their argument order is the seam).
CALLERS = {
    "sglang.srt.layers.layernorm": ("RMSNorm.forward_cuda", "GemmaRMSNorm._forward_impl"),
    "sglang.srt.model_executor.runner_backend_utils.weak_ref_tensor": ("weak_ref_tensors",),
}

STANDIN = StandinPackage(
    NAME,
    VERSION,
    IMPLEMENTED,
    missing="{op} was called, but the GPU lab has no sgl-kernel (the ddtree-sglang-gpu-lab stand-in "
    "implements {implemented}): the flags or model reach an SGLang path the GPU lab does not serve.",
    callers=CALLERS,
    require=seams.require,
    submodules=True,
    unimportable=UNIMPORTABLE,
)
StandinModule = STANDIN.module_class
install = STANDIN.install

