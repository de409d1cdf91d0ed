"""Target-verify attention for SGLang's ``torch_native`` backend (the one attention backend that runs on
a CPU here: the Triton ones run only under Triton's interpreter, and flashinfer is CUDA-only).

SGLang limitation: ``TorchNativeAttnBackend.forward_extend`` reads ``extend_prefix_lens`` /
``extend_seq_lens``, which TARGET_VERIFY batches leave None, and it has no custom mask, so it can
serve neither DFlash's verify (a chain block after the committed prefix) nor its drafter's block
pass (non-causal over context + block), nor a tree verify (ancestor-only mask).

For TARGET_VERIFY batches this module computes what SGLang's Triton backend computes for them
(``triton_backend.py``, ``forward_metadata`` for ``is_target_verify``): each request has ``n`` query
rows (the batch's rows / requests); it attends to its committed prefix ``req_to_token[r, :seq_lens[r]]``
read from the KV pool, and to the ``n`` new rows (their K/V as computed, also written to the pool at
``out_cache_loc`` as SGLang does). Which of those it may see:

* ``spec_info.custom_mask`` when present: per request a row-major bool ``[n, prefix + n]``,
  concatenated (the DDTREE tree: ancestors only, prefix visible);
* else the layer's causality: causal layers (the target) see the prefix and the rows up to their
  own; non-causal layers (the DFlash drafter, ENCODER_ONLY) see everything.

Every other forward mode runs SGLang's own code. Since the backend now applies the tree mask, the
DDTREE plugin's start-up refusal (``refusals.resolution.TREE_MASK_ATTENTION_BACKENDS``, which refuses
backends that would let tree siblings see each other) is told so in the processes where this is installed.

This decides what attention computes, so ``tests/sglang/test_cpu_lab_verify_attention.py`` checks it
against plain causal attention (chains) and against each tree node's root-to-node path run as a plain
sequence.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from ddtree_sglang_lab_base.hooks import after_import
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention

from ddtree_sglang_cpu_lab.seams import require


def verify_visibility(
    prefix_lens: list[int], rows: int, custom_mask: Tensor | None, causal: bool, device: torch.device
) -> list[Tensor]:
    """Per request the bool ``[rows, prefix + rows]`` of keys each verify row may attend to."""
    masks, offset = [], 0
    for prefix in prefix_lens:
        width = prefix + rows
        if custom_mask is not None:
            flat = custom_mask[offset : offset + rows * width]
            if flat.numel() != rows * width:
                raise ValueError(
                    f"custom_mask holds {custom_mask.numel()} entries; request needs [{rows}, {width}] "
                    f"from offset {offset}"
                )
            masks.append(flat.view(rows, width).to(device=device, dtype=torch.bool))
            offset += rows * width
            continue
        visible = torch.ones((rows, width), dtype=torch.bool, device=device)
        if causal:
            visible[:, prefix:] = torch.ones((rows, rows), dtype=torch.bool, device=device).tril()
        masks.append(visible)
    if custom_mask is not None and offset != custom_mask.numel():
        raise ValueError(f"custom_mask holds {custom_mask.numel()} entries, the batch uses {offset}")
    return masks


def verify_attention(
    q: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    prefix_lens: Tensor,
    *,
    custom_mask: Tensor | None,
    causal: bool,
    scaling: float | None,
) -> Tensor:
    """``q [b*n, Hq, D]``, ``k_new / v_new [b*n, Hkv, D]`` -> ``[b*n, Hq, Dv]`` (see module docstring)."""
    bs = int(req_pool_indices.shape[0])
    if bs == 0:
        return q.new_empty((0, q.shape[1], v_new.shape[-1]))
    rows = q.shape[0] // bs
    if rows * bs != q.shape[0]:
        raise ValueError(f"{q.shape[0]} verify rows do not split evenly over {bs} requests")
    prefixes = [int(p) for p in prefix_lens.tolist()]
    masks = verify_visibility(prefixes, rows, custom_mask, causal, q.device)
    out = q.new_empty((q.shape[0], q.shape[1], v_new.shape[-1]))
    for r, prefix in enumerate(prefixes):
        span = slice(r * rows, (r + 1) * rows)
        slots = req_to_token[int(req_pool_indices[r]), :prefix].long()
        keys = torch.cat([k_cache[slots].to(q.dtype), k_new[span].to(q.dtype)])
        values = torch.cat([v_cache[slots].to(q.dtype), v_new[span].to(q.dtype)])
        o = scaled_dot_product_attention(
            q[span].movedim(0, 1).unsqueeze(0),  # [1, Hq, n, D]
            keys.movedim(0, 1).unsqueeze(0),  # [1, Hkv, prefix + n, D]
            values.movedim(0, 1).unsqueeze(0),
            attn_mask=masks[r],
            scale=scaling,
            enable_gqa=q.shape[1] != keys.shape[1],
        )
        out[span] = o.squeeze(0).movedim(0, 1)
    return out


def _verify_forward_extend(backend: Any, q, k, v, layer, forward_batch, save_kv_cache=True):
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
        raise NotImplementedError(
            "ddtree-sglang-cpu-lab: sliding-window layers in a target-verify batch are not supported on "
            "the lab's CPU path (the lab models use full attention)"
        )
    cache_loc = forward_batch.out_cache_loc
    pool = backend.token_to_kv_pool
    if k is None or v is None:  # the layer reuses K/V another layer wrote: read them back
        k = pool.get_key_buffer(layer.layer_id)[cache_loc]
        v = pool.get_value_buffer(layer.layer_id)[cache_loc]
    elif save_kv_cache:
        pool.set_kv_buffer(layer, KVWriteLoc(cache_loc, backend.swa_out_cache_loc), k, v)
    causal = not (layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY)
    spec_info = forward_batch.spec_info
    o = verify_attention(
        q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim),
        k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim),
        v.reshape(-1, layer.tp_v_head_num, layer.v_head_dim),
        pool.get_key_buffer(layer.layer_id),
        pool.get_value_buffer(layer.layer_id),
        backend.req_to_token_pool.req_to_token,
        forward_batch.req_pool_indices,
        forward_batch.seq_lens,
        custom_mask=getattr(spec_info, "custom_mask", None),
        causal=causal,
        scaling=layer.scaling,
    )
    return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)


def _patch_backend(module: ModuleType) -> None:
    require(module, module.__name__, "TorchNativeAttnBackend.forward_extend")
    backend_cls = module.TorchNativeAttnBackend
    original = backend_cls.forward_extend

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if forward_batch.forward_mode.is_target_verify():
            return _verify_forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache)
        return original(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    forward_extend.__wrapped__ = original  # type: ignore[attr-defined]
    backend_cls.forward_extend = forward_extend


def _allow_tree_verify(refusals: ModuleType) -> None:
    if "torch_native" not in refusals.TREE_MASK_ATTENTION_BACKENDS:
        refusals.TREE_MASK_ATTENTION_BACKENDS = (*refusals.TREE_MASK_ATTENTION_BACKENDS, "torch_native")


def install() -> None:
    after_import("sglang.srt.layers.attention.torch_native_backend", _patch_backend)
    after_import("ddtree_runtime.sglang_plugin.refusals.resolution", _allow_tree_verify)
