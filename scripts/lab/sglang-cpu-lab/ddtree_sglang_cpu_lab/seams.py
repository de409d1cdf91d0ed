"""The SGLang code each work-around relies on, pinned by content.

A work-around keys on SGLang 0.5.23's module and function names and on what those functions do. Each
seam records the function's source digest (read from the imported function) as read when the
work-around was written; ``moved()`` lists the seams whose source changed in the installed wheel, and a
work-around refuses to patch a moved seam (``require``), so a new wheel fails loudly at start-up instead
of serving on a stale patch. The mechanism is the base's (``base.seams``), shared with the GPU lab's
layer; the seams are this layer's. ``tests/sglang/test_cpu_lab_seams.py`` checks every seam against the
installed wheel.
"""

from __future__ import annotations

from ddtree_sglang_lab_base.seams import Seam, SeamMoved, Seams, object_digest, resolve

from ddtree_sglang_cpu_lab import DISTRIBUTION

SEAMS: tuple[Seam, ...] = (
    Seam("sglang.kernels.ops.kvcache.cache_move", "copy_all_layer_kv_cache_func", "d9fbb4b3a29b2b9d",
         "CPU mode calls sgl_kernel.copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt, src)",
         "sgl_kernel_standin"),
    Seam("sglang.srt.mem_cache.allocation", "assign_req_to_token_pool_func", "598fab3dd718a36d",
         "CPU mode calls sgl_kernel.assign_req_to_token_pool_cpu(req, req_to_token, start, end, loc, "
         "pool_len)",
         "sgl_kernel_standin"),
    Seam("sglang.kernels.ops.speculative.cache_locs", "assign_extend_cache_locs_func", "3e1426eb94697423",
         "CPU mode calls sgl_kernel.assign_extend_cache_locs_cpu(req, req_to_token, start, end, out, "
         "pool_len)",
         "sgl_kernel_standin"),
    Seam("sglang.kernels.ops.speculative.cache_locs", "fill_front_out_cache_loc_func", "6158d6e69f1d9406",
         "CPU mode calls sgl_kernel.assign_extend_cache_locs_cpu to pack each window's front",
         "sgl_kernel_standin"),
    Seam("sglang.srt.arg_groups.speculative_hook", "_handle_dflash", "61143f903a1baeae",
         "DFLASH is refused on an in-tree platform other than cuda/npu/xpu (the CPU platform)",
         "dflash_on_cpu"),
    Seam("sglang.srt.arg_groups.speculative_hook", "_resolve_dflash_draft_attention_backend",
         "f71323e34176d56a",
         "the DFLASH draft backend must be one the platform supports; the CPU platform names none",
         "dflash_on_cpu"),
    Seam("sglang.srt.speculative.dflash_worker_v2", "DFlashWorkerV2.forward_batch_generation",
         "25e27378abd4541c",
         "record_stream with the CPU device module's stream ('unknown parameter type')",
         "dflash_on_cpu"),
    Seam("sglang.srt.layers.attention.torch_native_backend", "TorchNativeAttnBackend.forward_extend",
         "20ccf37226af9ec8",
         "torch_native cannot run TARGET_VERIFY batches (no extend lens, no custom mask)",
         "verify_attention"),
    Seam("sglang.srt.layers.attention.triton_backend", "TritonAttnBackend.init_forward_metadata",
         "89506ac4b4bb59ec",
         "what a TARGET_VERIFY batch attends to (prefix from seq_lens, custom_mask [n, prefix + n] per "
         "request, else the layer's causality): the semantics verify_attention reproduces",
         "verify_attention"),
    Seam("sglang.srt.speculative.draft_worker_common", "make_draft_block_spec_info", "dd58254a250e1686",
         "the DFlash drafter's block pass carries no custom mask (non-causal ENCODER_ONLY layers)",
         "verify_attention"),
    Seam("sglang.srt.models.dflash", "DFlashAttention.__init__", "6e2d4273099d06b2",
         "the drafter's q/k norm + rope is one Triton kernel (interpreted on a CPU) for bf16 neox layers",
         "drafter_rope"),
    Seam("sglang.srt.models.dflash", "DFlashAttention.forward", "80263c480be002d6",
         "use_table_qk_norm_rope picks the fused kernel, else apply_qk_norm then rotary_emb",
         "drafter_rope"),
    Seam("sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state",
         "_resolve_dflash_aux_hidden_state", "9d5b7bdb60be6061",
         "hidden-state capture is decided by is_dflash_family() (the capture_predicate fault switch)",
         "faults"),
    Seam("sglang.srt.model_executor.model_runner", "ModelRunner.forward", "dbb8b4493815aed9",
         "the target forward takes its capture mode from the forward batch (the hidden_none fault switch)",
         "faults"),
)


# SEAMS is read at each call: a test swaps it for a stale copy.
_SEAMS = Seams(DISTRIBUTION, "ddtree_sglang_cpu_lab", lambda: SEAMS, read="object")
seam_named = _SEAMS.seam_named
moved_message = _SEAMS.moved_message
require = _SEAMS.require
moved = _SEAMS.moved
check_version = _SEAMS.check_version
source_digest = object_digest

__all__ = ["SEAMS", "Seam", "SeamMoved", "check_version", "moved", "moved_message", "require", "resolve",
           "seam_named", "source_digest"]
