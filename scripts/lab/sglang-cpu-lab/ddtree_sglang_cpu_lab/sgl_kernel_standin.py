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
``sgl_kernel`` is importable. The stand-in mechanism is the base's (``base.standin``), shared with the
GPU lab's layer; the ops are this layer's.
"""

from __future__ import annotations

import ctypes
from typing import Any

from ddtree_sglang_lab_base.standin import MissingOp as MissingOp  # raised by the ops
from ddtree_sglang_lab_base.standin import StandinPackage

from ddtree_sglang_cpu_lab import seams

NAME = "sgl_kernel"
VERSION = "0.0.0+ddtree-cpu-lab-standin"


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


# SGLang's callers of the implemented ops (the argument order they pass is the seam).
CALLERS = {
    "sglang.kernels.ops.kvcache.cache_move": ("copy_all_layer_kv_cache_func",),
    "sglang.srt.mem_cache.allocation": ("assign_req_to_token_pool_func",),
    "sglang.kernels.ops.speculative.cache_locs": (
        "assign_extend_cache_locs_func",
        "fill_front_out_cache_loc_func",
    ),
}

# No submodule resolves: SGLang falls back on ImportError where it can (``sgl_kernel.scalar_type``).
STANDIN = StandinPackage(
    NAME,
    VERSION,
    IMPLEMENTED,
    missing="{op} was called, but this lab host has no sgl_kernel CPU build (the ddtree-sglang-cpu-lab "
    "stand-in implements only {implemented}): the flags or model reach an SGLang path the lab cannot serve.",
    callers=CALLERS,
    require=seams.require,
)
StandinModule = STANDIN.module_class
install = STANDIN.install

