"""The lab CPU layer runs the DFlash drafter's q/k norm + RoPE unfused (``drafter_rope``): SGLang's own two
steps, as its CPU mode runs them without AMX (``apply_qk_norm``'s per-head ``RMSNorm`` and the layer's
``rotary_emb``, both ``forward_native``), must give the q and k of its fused Triton kernel
(``table_qk_norm_rope_``, run here in Triton's interpreter) on the same bf16 input."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ddtree_sglang_cpu_lab")
pytestmark = pytest.mark.sglang

HEADS, KV_HEADS, HEAD_DIM, TOKENS = 4, 2, 16, 16


@pytest.mark.parametrize("seed", [0, 1])
def test_unfused_qk_norm_and_rope_equal_the_fused_kernel(seed, monkeypatch):
    from sglang.kernels.ops.attention.table_qk_norm_rope import table_qk_norm_rope_
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.rotary_embedding import base, get_rope

    monkeypatch.setattr(base, "_is_cpu", True)  # this test process is not in SGLang's CPU mode

    g = torch.Generator().manual_seed(seed)
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = torch.randn(TOKENS, q_size + 2 * kv_size, generator=g).to(torch.bfloat16)
    positions = torch.randint(0, 500, (TOKENS,), generator=g)
    q_norm, k_norm = RMSNorm(HEAD_DIM, eps=1e-6), RMSNorm(HEAD_DIM, eps=1e-6)
    with torch.no_grad():
        q_norm.weight.copy_(1 + 0.2 * torch.randn(HEAD_DIM, generator=g))
        k_norm.weight.copy_(1 + 0.2 * torch.randn(HEAD_DIM, generator=g))
    q_norm, k_norm = q_norm.to(torch.bfloat16), k_norm.to(torch.bfloat16)
    rope = get_rope(HEAD_DIM, rotary_dim=HEAD_DIM, max_position=4096, base=10000.0, is_neox_style=True)

    fused = qkv.clone()
    table_qk_norm_rope_(fused, positions, q_norm.weight, k_norm.weight, rope.cos_sin_cache,
                        HEADS, KV_HEADS, HEAD_DIM, q_norm.variance_epsilon)  # fmt: skip
    fq, fk, _ = fused.split([q_size, kv_size, kv_size], dim=-1)

    q, k, _ = qkv.clone().split([q_size, kv_size, kv_size], dim=-1)
    q = q_norm.forward_native(q.reshape(-1, HEAD_DIM)).view(q.shape)
    k = k_norm.forward_native(k.reshape(-1, HEAD_DIM)).view(k.shape)
    q, k = rope.forward_native(positions, q, k)

    torch.testing.assert_close(q.float().reshape(fq.shape), fq.float(), rtol=0.02, atol=0.02)
    torch.testing.assert_close(k.float().reshape(fk.shape), fk.float(), rtol=0.02, atol=0.02)
