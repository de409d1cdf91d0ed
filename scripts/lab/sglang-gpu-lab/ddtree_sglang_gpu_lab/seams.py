"""The SGLang code each GPU-lab work-around relies on, pinned by content.

The mechanism is the CPU layer's (``ddtree_sglang_lab_base.seams``, the base both layers share):
each seam records a source digest taken when the work-around was written, and a work-around refuses to
patch a moved seam. Digests are read from the module's file (``ast``), not from an imported object:
several of these modules refuse to import without CUDA (``weak_ref_tensor.py`` raises on a CPU), and
``tests/sglang/test_gpu_lab_layer.py`` checks them all on CPU against the installed wheel.
"""

from __future__ import annotations

from ddtree_sglang_lab_base.seams import Seam, SeamMoved, Seams, file_digest

from ddtree_sglang_gpu_lab import DISTRIBUTION

SEAMS: tuple[Seam, ...] = (
    Seam(
        "sglang.srt.layers.layernorm",
        "RMSNorm.forward_cuda",
        "bae8ae6279fa203d",
        "RMSNorm on CUDA calls sgl_kernel.rmsnorm(x, w, eps) / fused_add_rmsnorm(x, residual, w, eps)",
        "sgl_kernel_standin",
    ),
    Seam(
        "sglang.srt.layers.layernorm",
        "GemmaRMSNorm._forward_impl",
        "74f6f0cb265efd4b",
        "GemmaRMSNorm on CUDA calls sgl_kernel.gemma_rmsnorm / gemma_fused_add_rmsnorm(x, residual, w, eps)",
        "sgl_kernel_standin",
    ),
    Seam(
        "sglang.srt.model_executor.runner_backend_utils.weak_ref_tensor",
        "weak_ref_tensors",
        "0f23162ad370068f",
        "the breakable prefill graph weak-references its outputs through sgl_kernel.weak_ref_tensor",
        "sgl_kernel_standin",
    ),
    Seam(
        "sglang.srt.layers.dual_gemm",
        "DualGemm._select_mode",
        "0f62a9ccc2919ad0",
        "every dense MLP imports the CUTLASS-DSL dual GEMM module to ask can_use_dual_gemm (SM100 only)",
        "cutedsl_standin",
    ),
    Seam(
        "sglang.srt.speculative.dflash_utils",
        "is_dflash_sampling_verify_available",
        "dfc33a0545717023",
        "DFLASH's sampling verify kernel compiles against flashinfer's headers; without it SGLang verifies "
        "greedily",
        "sampling_fallback",
    ),
)


# SEAMS is read at each call: a test swaps it for a stale copy.
_SEAMS = Seams(DISTRIBUTION, "ddtree_sglang_gpu_lab", lambda: SEAMS, read="file")
seam_named = _SEAMS.seam_named
moved_message = _SEAMS.moved_message
require = _SEAMS.require
moved = _SEAMS.moved
check_version = _SEAMS.check_version
source_digest = file_digest

__all__ = ["SEAMS", "Seam", "SeamMoved", "check_version", "moved", "moved_message", "require", "seam_named",
           "source_digest"]
