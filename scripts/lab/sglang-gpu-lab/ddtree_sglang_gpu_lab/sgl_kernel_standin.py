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
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

import torch

NAME = "sgl_kernel"
VERSION = "0.0.0+ddtree-gpu-lab-standin"
# Every submodule resolves (CUDA imports such as ``gguf.py``'s ``sgl_kernel.quantization`` are not
# guarded), except these, whose ImportError SGLang answers with a fallback of its own
# (``layers/quantization/utils.py`` ~11: ``scalar_type``).
UNIMPORTABLE = ("scalar_type",)


class MissingOp(NotImplementedError):
    pass


def _missing(qualname: str) -> Any:
    def op(*args: Any, **kwargs: Any) -> Any:
        raise MissingOp(
            f"{qualname} was called, but the GPU lab has no sgl-kernel (the ddtree-sglang-gpu-lab "
            f"stand-in implements {', '.join(sorted(IMPLEMENTED))}): the flags or model reach an "
            "SGLang path the GPU lab does not serve."
        )

    op.__name__ = qualname.rsplit(".", 1)[-1]
    op.__qualname__ = qualname
    return op


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


class StandinModule(ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        prefix = self.__name__[len(NAME) + 1 :]
        key = f"{prefix}.{name}" if prefix else name
        if key in IMPLEMENTED:
            return IMPLEMENTED[key]
        return _missing(f"{self.__name__}.{name}")


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = StandinModule(spec.name)
        module.__path__ = []  # a package: its submodules resolve through _Finder
        module.__version__ = VERSION
        return module

    def exec_module(self, module: ModuleType) -> None:
        return None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname != NAME and not fullname.startswith(f"{NAME}."):
            return None
        if fullname.split(".")[1:2] and fullname.split(".")[1] in UNIMPORTABLE:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)


# SGLang's callers of the implemented ops (their argument order is the seam).
CALLERS = {
    "sglang.srt.layers.layernorm": ("RMSNorm.forward_cuda", "GemmaRMSNorm._forward_impl"),
    "sglang.srt.model_executor.runner_backend_utils.weak_ref_tensor": ("weak_ref_tensors",),
}


def _check_callers(module: ModuleType) -> None:
    from ddtree_sglang_gpu_lab.seams import require

    for qualname in CALLERS[module.__name__]:
        require(module, module.__name__, qualname)


def install() -> bool:
    """Put the stand-in on the import path unless a real sgl_kernel is importable."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return True
    if importlib.util.find_spec(NAME) is not None:
        return False
    from ddtree_sglang_cpu_lab.hooks import after_import

    sys.meta_path.append(_Finder())
    for module in CALLERS:
        after_import(module, _check_callers)
    return True
