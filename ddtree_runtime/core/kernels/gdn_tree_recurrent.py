"""The Gated DeltaNet recurrence of a tree verify, keeping the parent's state in registers when the
parent is the row just computed.

SGLang 0.5.23's ``fused_sigmoid_gating_delta_rule_update`` (``kernels/ops/attention/linear/
fused_sigmoid_gating_recurrent.py``) verifies a tree by reloading, before every row but the first,
the parent row's SSM state from the per-row scratch it has just written: 64 KiB per value head and
row with fp32 state, read back from memory even when the parent is the previous row, whose state is
still in registers. On Qwen3.6-27B's shape that reload is most of what a 17-row tree costs over the
16-row chain on the GDN layers at eight requests (``docs/bench/gdn-tree-price.md``: 178 against 120
us a layer, fp32 state).

This kernel is that kernel's tree-verify path (GDN gating, q/k L2 norm, variable lengths, per-row
scratch, no state write-back), with one change: a row whose parent is the previous row takes the
state from registers, rounded to the scratch's dtype, which is exactly the value the reload would
read (the scratch stores ``state.to(dtype)``), so every output and every scratch row is bit-identical
to SGLang's kernel. Every other line keeps SGLang's arithmetic in SGLang's order; the tests compare
the two bit for bit (``tests/unit/test_gdn_tree_recurrent.py``, Triton's interpreter on the CPU;
``tests/gpu/`` on the device). How often a parent is the previous row depends on the tree's row
order; ``parent_is_previous_fraction`` measures it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T"])
def _gdn_tree_verify_kernel(
    A_log,
    a,
    dt_bias,
    softplus_beta,
    softplus_threshold,
    q,
    k,
    v,
    b,
    o,
    h0_source,
    h0_indices,
    stride_h0_source,
    cu_seqlens,
    intermediate_states_buffer,
    intermediate_state_indices,
    cache_steps,
    retrieve_parent_token_ptr,
    stride_retrieve_parent_token_seq: tl.constexpr,
    stride_retrieve_parent_token_token: tl.constexpr,
    scale,
    T,
    stride_a,
    stride_q,
    stride_k,
    stride_v,
    stride_b,
    NP2_T: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_QK_L2NORM_IN_KERNEL: tl.constexpr,
    SPLIT_N_HV_GRID: tl.constexpr,
    REUSE_PARENT: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):
    if SPLIT_N_HV_GRID:
        i_v, i_n, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        i_k = 0
    else:
        i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        i_n, i_hv = i_nh // HV, i_nh % HV
    # PDL: as SGLang's kernel (scheduling only; every load below comes after the wait).
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    i_h = i_hv // (HV // H)
    bos, eos = (
        tl.load(cu_seqlens + i_n).to(tl.int64),
        tl.load(cu_seqlens + i_n + 1).to(tl.int64),
    )
    all = T
    T = eos - bos

    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    p_q = q + bos * stride_q + i_h * K + o_k
    p_k = k + bos * stride_k + i_h * K + o_k
    p_v = v + bos * stride_v + i_hv * V + o_v
    p_b = b + bos * stride_b + i_hv
    p_o = o + ((i_k * all + bos) * HV + i_hv) * V + o_v
    p_A_log = A_log + i_hv
    p_a = a + bos * stride_a + i_hv
    p_dt_bias = dt_bias + i_hv

    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    idx = tl.load(h0_indices + i_n).to(tl.int64)
    if idx >= 0:
        p_h0 = h0_source + idx * stride_h0_source + i_hv * K * V + o_v[None, :] * K + o_k[:, None]
        b_h += tl.load(p_h0, mask=mask_h, other=0).to(tl.float32)

    token_indices = tl.arange(0, NP2_T)
    parent_idx_tokens = tl.load(
        retrieve_parent_token_ptr
        + i_n * stride_retrieve_parent_token_seq
        + token_indices * stride_retrieve_parent_token_token,
        mask=token_indices < T,
        other=0,
    )
    cache_idx = tl.load(intermediate_state_indices + i_n).to(tl.int64)
    cache_base = intermediate_states_buffer + cache_idx * cache_steps * HV * K * V + i_hv * K * V
    cache_cell = o_v[None, :] * K + o_k[:, None]

    step_idx = 0
    for _ in range(0, T):
        if step_idx != 0 and cache_idx >= 0:
            parent_step_idx = tl.sum(tl.where(token_indices == step_idx, parent_idx_tokens, 0))
            parent_ptr = cache_base + parent_step_idx * HV * K * V + cache_cell
            if REUSE_PARENT:  # a compile-time branch; the runtime test inside it is per program
                if parent_step_idx == step_idx - 1:
                    # The previous row's state, as the scratch holds it (the reload would read this).
                    b_h = b_h.to(intermediate_states_buffer.dtype.element_ty).to(tl.float32)
                else:
                    b_h = tl.load(parent_ptr, mask=mask_h, other=0).to(tl.float32)
            else:
                b_h = tl.load(parent_ptr, mask=mask_h, other=0).to(tl.float32)

        b_q = tl.load(p_q, mask=mask_k, other=0).to(tl.float32)
        b_k = tl.load(p_k, mask=mask_k, other=0).to(tl.float32)
        b_v = tl.load(p_v, mask=mask_v, other=0).to(tl.float32)
        b_b = tl.load(p_b).to(tl.float32)
        b_A_log = tl.load(p_A_log).to(tl.float32)
        b_a = tl.load(p_a).to(tl.float32)
        b_dt_bias = tl.load(p_dt_bias).to(tl.float32)

        # g = -exp(A_log) * softplus(a + dt_bias); beta = sigmoid(b)
        x = b_a + b_dt_bias
        beta_x = softplus_beta * x
        softplus_x = tl.where(
            beta_x <= softplus_threshold,
            (1.0 / softplus_beta) * tl.log(1.0 + tl.exp(beta_x)),
            x,
        )
        b_g = -tl.exp(b_A_log) * softplus_x
        b_beta = 1.0 / (1.0 + tl.exp(-b_b))

        if USE_QK_L2NORM_IN_KERNEL:
            q_sum_sq = tl.sum(b_q * b_q)
            k_sum_sq = tl.sum(b_k * b_k)
            q_rsqrt = 1.0 / tl.sqrt(q_sum_sq + 1e-6)
            k_rsqrt = 1.0 / tl.sqrt(k_sum_sq + 1e-6)
            b_q *= q_rsqrt
            b_k *= k_rsqrt
        b_q = b_q * scale

        b_h *= tl.exp(b_g)
        b_v -= tl.sum(b_h * b_k[:, None], 0)
        b_v *= b_beta
        b_h += b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0)
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mask_v)

        if cache_idx >= 0:
            cache_ptr = cache_base + step_idx * HV * K * V + cache_cell
            tl.store(cache_ptr, b_h.to(cache_ptr.dtype.element_ty), mask=mask_h)

        step_idx += 1  # noqa: SIM113 (SGLang's loop, kept as is: same code, same compiled arithmetic)
        p_q += stride_q
        p_k += stride_k
        p_v += stride_v
        p_b += stride_b
        p_o += HV * V
        p_a += stride_a


def gdn_tree_verify(
    A_log: torch.Tensor,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    softplus_beta: float,
    softplus_threshold: float,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor,
    initial_state_source: torch.Tensor,
    initial_state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    intermediate_states_buffer: torch.Tensor,
    intermediate_state_indices: torch.Tensor,
    retrieve_parent_token: torch.Tensor,
    *,
    block_v: int,
    num_warps: int,
    use_qk_l2norm_in_kernel: bool = True,
    scale: float | None = None,
    use_pdl: bool = False,
    reuse_parent: bool = True,
) -> torch.Tensor:
    """SGLang's ``fused_sigmoid_gating_delta_rule_update`` for a GDN tree verify (``is_kda=False``,
    ``disable_state_update=True``, per-row scratch, parents given), same arguments and output
    ``[1, N, HV, V]`` (SGLang squeezes its leading 1). ``block_v`` / ``num_warps``: the launch SGLang
    would choose (its ``_select_recurrent_launch_config``; the caller asks it). ``reuse_parent=False``
    reloads every parent as SGLang does (the baseline the benchmark and the tests compare)."""
    _, _, H, K = k.shape
    V, HV = v.shape[-1], v.shape[2]
    N = len(cu_seqlens) - 1
    BK = triton.next_power_of_2(K)
    if BK < K:
        raise ValueError(f"head dim {K} does not fit one tile")
    scale = K**-0.5 if scale is None else scale
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    o = q.new_empty(1, *v.shape)
    NV = triton.cdiv(V, block_v)
    split = q.device.type == "cuda"
    grid = (NV, N, HV) if split else (1, NV, N * HV)
    cache_steps = intermediate_states_buffer.stride(0) // (HV * K * V)
    T = k.shape[1]
    _gdn_tree_verify_kernel[grid](
        A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b, o,
        initial_state_source, initial_state_indices, initial_state_source.stride(0), cu_seqlens,
        intermediate_states_buffer, intermediate_state_indices, cache_steps,
        retrieve_parent_token, retrieve_parent_token.stride(0), retrieve_parent_token.stride(1),
        scale, T, a.stride()[-2], q.stride()[1], k.stride()[1], v.stride()[1], b.stride()[-2],
        NP2_T=triton.next_power_of_2(T), H=H, HV=HV, K=K, V=V, BK=BK, BV=block_v,
        USE_QK_L2NORM_IN_KERNEL=use_qk_l2norm_in_kernel, SPLIT_N_HV_GRID=split, REUSE_PARENT=reuse_parent,
        num_warps=num_warps, num_stages=3,
        **({"USE_GDC": True, "launch_pdl": True} if use_pdl else {}),
    )  # fmt: skip
    return o.squeeze(0)


def parent_is_previous_fraction(parents: torch.Tensor) -> float:
    """Of a verify's rows after the first, the share whose parent is the row before it (``parents``:
    ``[b, rows]`` row indices, -1 for the root and padding): the rows this kernel keeps in registers."""
    rows = torch.arange(parents.shape[1], device=parents.device)
    real = parents[:, 1:] >= 0
    previous = (parents[:, 1:] == rows[:-1]) & real
    return float(previous.sum()) / max(int(real.sum()), 1)
