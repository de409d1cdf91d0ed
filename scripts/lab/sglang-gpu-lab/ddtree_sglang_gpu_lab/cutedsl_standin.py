"""Stands in for ``sglang.kernels.ops.gemm.cutedsl_dual_gemm`` when NVIDIA's CUTLASS DSL is absent.

SGLang limitation: every dense MLP asks ``layers/dual_gemm.py`` (``DualGemm._select_mode``) whether the
Blackwell (SM100) dual GEMM applies, and that import pulls ``cutlass`` and ``cuda.bindings`` (the
``nvidia-cutlass-dsl`` package, which a GPU host installs and the device lacks) before the predicate is
asked. On the H200 (SM90) the real ``can_use_dual_gemm`` answers False for every shape
(``is_sm100_supported()`` is part of it), so the stand-in answers False and the MLP runs SGLang's own
separate GEMMs and activation. It keeps the module's constants and quantisation modes; its kernels
raise if called.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from enum import IntEnum
from types import ModuleType
from typing import Any

NAME = "sglang.kernels.ops.gemm.cutedsl_dual_gemm"
MAX_DUAL_GEMM_DECODE_TOKENS = 16


class DualGemmQuantMode(IntEnum):
    STATIC_PER_TENSOR = 0
    STATIC_PER_TOKEN = 1
    DYNAMIC_PER_TENSOR = 2
    DYNAMIC_PER_TOKEN = 3
    UNQUANT = 4

    @property
    def is_dynamic(self) -> bool:
        return self in (DualGemmQuantMode.DYNAMIC_PER_TENSOR, DualGemmQuantMode.DYNAMIC_PER_TOKEN)

    @property
    def is_per_token(self) -> bool:
        return self in (DualGemmQuantMode.STATIC_PER_TOKEN, DualGemmQuantMode.DYNAMIC_PER_TOKEN)


def can_use_dual_gemm(num_tokens: int, hidden_size: int, intermediate_size: int, quant_mode: Any) -> bool:
    return False  # SM100 only; what the real predicate answers on the H200


def _no_kernel(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("the SM100 dual GEMM kernel is not in the GPU lab (the H200 is SM90)")


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = ModuleType(spec.name)
        module.MAX_DUAL_GEMM_DECODE_TOKENS = MAX_DUAL_GEMM_DECODE_TOKENS  # type: ignore[attr-defined]
        module.DualGemmQuantMode = DualGemmQuantMode  # type: ignore[attr-defined]
        module.can_use_dual_gemm = can_use_dual_gemm  # type: ignore[attr-defined]
        module.__getattr__ = lambda name: _no_kernel  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: ModuleType) -> None:
        return None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname == NAME:
            return importlib.machinery.ModuleSpec(fullname, _Loader())
        return None


def _check_caller(module: ModuleType) -> None:
    from ddtree_sglang_gpu_lab.seams import require

    require(module, module.__name__, "DualGemm._select_mode")


def install() -> bool:
    """Answer for the module unless the CUTLASS DSL it needs is importable."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return True
    if importlib.util.find_spec("cutlass") is not None:
        return False
    from ddtree_sglang_lab_base.hooks import after_import

    sys.meta_path.insert(0, _Finder())  # before the path finder that would load the real file
    after_import("sglang.srt.layers.dual_gemm", _check_caller)
    return True
