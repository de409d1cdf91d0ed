"""SGLang limitation: its CPU mode (``SGLANG_USE_CPU_ENGINE=1``) imports ``sgl_kernel`` at module import
time, and no CPU build of ``sgl_kernel`` installs here (PyPI's ``sgl-kernel`` / ``sglang-kernel`` are
CUDA builds; SGLang's CPU kernels are compiled from its repository for AVX512/AMX).

The stand-in is a module whose names resolve to functions that raise, naming the op, when called
(its submodules stay unimportable: SGLang falls back on ImportError where it can, e.g.
``sgl_kernel.scalar_type`` in ``layers/quantization/utils.py``). The lab's path calls none of them
except the three in ``IMPLEMENTED``, plain torch versions of what SGLang's Triton kernels of the same
job do (``kernels/ops/kvcache/cache_move.copy_all_layer_kv_cache_tiled``,
``srt/mem_cache/allocation.assign_req_to_token_pool`` and
``kernels/ops/speculative/cache_locs.assign_extend_cache_locs``). Installed only when no real
``sgl_kernel`` is importable.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

NAME = "sgl_kernel"
VERSION = "0.0.0+ddtree-cpu-lab-standin"


class MissingOp(NotImplementedError):
    pass


def _missing(qualname: str) -> Any:
    def op(*args: Any, **kwargs: Any) -> Any:
        raise MissingOp(
            f"{qualname} was called, but this lab host has no sgl_kernel CPU build (the "
            f"ddtree-sglang-cpu-lab stand-in implements only {', '.join(sorted(IMPLEMENTED))}): the "
            "flags or model reach an SGLang path the lab cannot serve."
        )

    op.__name__ = qualname.rsplit(".", 1)[-1]
    op.__qualname__ = qualname
    return op


def copy_all_layer_kv_cache_cpu(data_ptrs: Any, strides: Any, tgt_loc: Any, src_loc: Any) -> None:
    """For every layer buffer (raw base pointer, row stride in bytes) copy row ``src_loc[i]`` to row
    ``tgt_loc[i]``. All sources are read before any target is written, as the Triton kernel does
    (safe when the two sets overlap)."""
    pairs = list(zip(src_loc.tolist(), tgt_loc.tolist(), strict=True))
    if not pairs:
        return
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = ctypes.create_string_buffer(len(pairs) * stride)
        scratch = ctypes.addressof(rows)
        for i, (src, _) in enumerate(pairs):
            ctypes.memmove(scratch + i * stride, base + src * stride, stride)
        for i, (_, tgt) in enumerate(pairs):
            ctypes.memmove(base + tgt * stride, scratch + i * stride, stride)


def assign_req_to_token_pool_cpu(
    req_pool_indices: Any, req_to_token: Any, start_offset: Any, end_offset: Any, out_cache_loc: Any,
    pool_len: int,
) -> None:
    """``req_to_token[req, start:end] = out_cache_loc[consecutive run]`` for each request in order."""
    offset = 0
    for req, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        n = end - start
        req_to_token[req, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def assign_extend_cache_locs_cpu(
    req_pool_indices: Any, req_to_token: Any, start_offset: Any, end_offset: Any, out_cache_loc: Any,
    pool_len: int,
) -> None:
    """``out_cache_loc[consecutive run] = req_to_token[req, start:end]`` for each request in order (the
    inverse gather of ``assign_req_to_token_pool_cpu``)."""
    offset = 0
    for req, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        n = end - start
        out_cache_loc[offset : offset + n] = req_to_token[req, start:end].to(out_cache_loc.dtype)
        offset += n


IMPLEMENTED = {
    "copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache_cpu,
    "assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
    "assign_extend_cache_locs_cpu": assign_extend_cache_locs_cpu,
}


class StandinModule(ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in IMPLEMENTED:
            return IMPLEMENTED[name]
        return _missing(f"{self.__name__}.{name}")


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = StandinModule(spec.name)
        module.__path__ = []  # a package without submodules
        module.__version__ = VERSION
        return module

    def exec_module(self, module: ModuleType) -> None:
        return None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname == NAME:
            return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
        return None


# SGLang's callers of the implemented ops (the argument order they pass is the seam).
CALLERS = {
    "sglang.kernels.ops.kvcache.cache_move": ("copy_all_layer_kv_cache_func",),
    "sglang.srt.mem_cache.allocation": ("assign_req_to_token_pool_func",),
    "sglang.kernels.ops.speculative.cache_locs": (
        "assign_extend_cache_locs_func",
        "fill_front_out_cache_loc_func",
    ),
}


def _check_callers(module: ModuleType) -> None:
    from ddtree_sglang_cpu_lab.seams import require

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
