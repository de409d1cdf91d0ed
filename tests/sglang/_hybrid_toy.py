"""A tiny hybrid target (one Gated DeltaNet layer, then one attention layer) whose GDN layer runs
through SGLang 0.5.23's real hybrid machinery on CPU, for the plugin's worker tests.

Real SGLang parts: ``HybridReqToTokenPool`` (its ``MambaPool`` holds the conv/SSM state and the
per-row verify scratch), ``GDNAttnBackend._forward_metadata`` and ``forward_extend`` (the
TARGET_VERIFY branch: ``causal_conv1d_update`` and the fused recurrent kernel, Triton under
TRITON_INTERPRET=1), ``HybridLinearAttnBackend.forward`` / ``update_mamba_state_after_mtp_verify``
and ``spec_utils.commit_mamba_states_after_verify``. The backends are built without a ModelRunner
(``object.__new__`` plus the fields those methods read); the one CUDA-only call,
``scatter_mamba_states_after_mtp_verify``'s wrapper, is replaced on CPU by the backend's own CPU
scatter (``_scatter_speculative_state_with_mask``) with the same arguments.

The attention layer and the logits are the toy of ``_tree_decode_toy.py`` (float64, on SGLang's
KV pool); the GDN layer is float32 (its kernels' precision). ``reference_greedy`` decodes the same
model token by token in plain PyTorch (``ddtree_runtime.tiny_engine.gdn``): the plugin's tree rounds must
reproduce its tokens, and its recurrent state, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import Tensor

from ddtree_runtime.tiny_engine import gdn
from tests.sglang._tree_decode_toy import DTYPE, ToyModels, ToyTarget

H, HV, KD, VD, W = 2, 4, 8, 8, 4  # q/k heads, value heads, head dims, conv width
C = 2 * H * KD + HV * VD
GDN_LAYER = 0


def cache_params():
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape

    shape = Mamba2StateShape.create(
        tp_world_size=1, intermediate_size=HV * VD, n_groups=H, num_heads=HV, head_dim=VD,
        state_size=KD, conv_kernel=W,
    )
    dtype = Mamba2StateDType(conv=torch.float32, temporal=torch.float32)
    return Mamba2CacheParams(shape=shape, layers=[GDN_LAYER], dtype=dtype)


def make_hybrid_pool(*, rows: int, context: int, scratch_rows: int):
    """SGLang's HybridReqToTokenPool on CPU. Which conv-scratch layout it gets is SGLang's own
    ``conv_window_dedup_enabled`` decision (hooked by the plugin when DDTREE verifies trees)."""
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    return HybridReqToTokenPool(
        size=rows, mamba_size=rows, mamba_spec_state_size=rows, max_context_len=context, device="cpu",
        enable_memory_saver=False, cache_params=cache_params(), mamba_layer_ids=[GDN_LAYER],
        enable_mamba_extra_buffer=False, speculative_num_draft_tokens=scratch_rows,
        speculative_eagle_topk=1,  # what DDTREE publishes (DFlash forces top-k 1)
        enable_overlap_schedule=False,
    )


def alloc_requests(pool, n: int) -> list[int]:
    """Rows (and mamba slots) for n new requests, through the pool's own alloc."""
    reqs = [
        SimpleNamespace(kv=SimpleNamespace(
            req_pool_idx=None, holds_kv=False, kv_allocated_len=0, holds_mamba=False,
            mamba_pool_idx=None, mamba_needs_clear=False, mamba_ping_pong_track_buffer=None,
        ))
        for _ in range(n)
    ]
    return pool.alloc(reqs)


def make_backends(pool):
    """(HybridLinearAttnBackend, its GDNAttnBackend) over ``pool``, as a ModelRunner would wire them
    for a target whose only linear layer is ``GDN_LAYER`` (the full-attention side is the toy's)."""
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
    from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend, GDNKernelDispatcher
    from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend

    triton = LinearAttnKernelBackend.TRITON
    from ddtree_runtime.sglang_plugin.graph_sites import linear_backend_tree_hook

    linear = object.__new__(GDNAttnBackend)
    linear.__dict__.update(
        device="cpu", pad_slot_id=-1, topk=1, is_draft_worker=False, req_to_token_pool=pool,
        enable_unified_memory=False, _fused_state_indices_ok=False, forward_metadata=None,
        enable_mis=False, mis_metadata=None, _use_strided_target_verify_qkv=False,
        conv_states_shape=pool.mamba_pool.mamba_cache.conv[0].shape,
        kernel_dispatcher=GDNKernelDispatcher(triton, triton, triton),
        verify_intermediate_state_indices=torch.arange(pool.size + 1, dtype=torch.int32),
    )
    linear_backend_tree_hook(None, linear)  # what the plugin's hook does after SGLang's __init__
    full = SimpleNamespace(init_forward_metadata=lambda fb: None)
    hybrid = object.__new__(HybridLinearAttnBackend)
    hybrid.__dict__.update(
        full_attn_layers=[1], full_attn_backend=full, linear_attn_backend=linear,
        attn_backend_list=[full, linear],
    )
    return hybrid, linear


def cpu_scatter_mamba_states_after_mtp_verify(
    mamba_caches, state_indices_tensor, last_correct_step_indices, mamba_track_indices,
    mamba_steps_to_track, src_indices_raw=None,
):
    """``scatter_mamba_states_after_mtp_verify`` (CUDA/XPU only) on CPU: the same copies through
    SGLang's CPU scatter, ``HybridLinearAttnBackend._scatter_speculative_state_with_mask``."""
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend

    scatter = HybridLinearAttnBackend._scatter_speculative_state_with_mask
    pairs = [(mamba_caches.temporal, mamba_caches.intermediate_ssm)]
    pairs += list(zip(mamba_caches.conv, mamba_caches.intermediate_conv_window, strict=True))
    for dst, src in pairs:
        scatter(dst, src, state_indices_tensor, last_correct_step_indices, src_indices_raw)
        if mamba_track_indices is not None:
            scatter(dst, src, mamba_track_indices, mamba_steps_to_track, src_indices_raw)


@dataclass
class GDNWeights:
    dim: int
    seed: int = 5
    w_qkv: Tensor = field(init=False)
    w_a: Tensor = field(init=False)
    w_b: Tensor = field(init=False)
    conv: Tensor = field(init=False)
    bias: Tensor = field(init=False)
    A_log: Tensor = field(init=False)
    dt_bias: Tensor = field(init=False)
    w_out: Tensor = field(init=False)

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(self.seed)
        f = torch.float32
        self.w_qkv = torch.randn(self.dim, C, generator=g, dtype=f) / self.dim**0.5
        self.w_a = torch.randn(self.dim, HV, generator=g, dtype=f) / self.dim**0.5
        self.w_b = torch.randn(self.dim, HV, generator=g, dtype=f) / self.dim**0.5
        self.conv = torch.randn(C, W, generator=g, dtype=f) * 0.6
        self.bias = torch.randn(C, generator=g, dtype=f) * 0.1
        self.A_log = torch.randn(HV, generator=g, dtype=f) * 0.3
        self.dt_bias = torch.randn(HV, generator=g, dtype=f) * 0.3
        self.w_out = torch.randn(HV * VD, self.dim, generator=g, dtype=DTYPE) * 1.5

    def inputs(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        xf = x.float()
        return xf @ self.w_qkv, xf @ self.w_a, xf @ self.w_b

    def layer(self):
        """The fields SGLang's GDN backend reads from a RadixLinearAttention."""
        return SimpleNamespace(
            layer_id=GDN_LAYER, conv_weights=self.conv, bias=self.bias, activation="silu",
            A_log=self.A_log, dt_bias=self.dt_bias, q_dim=H * KD, k_dim=H * KD, v_dim=HV * VD,
            num_q_heads=H, num_k_heads=H, num_v_heads=HV, head_q_dim=KD, head_k_dim=KD, head_v_dim=VD,
        )


class HybridToyTarget(ToyTarget):
    """GDN layer (residual) then the toy's attention head: ``x' = x + o_gdn @ w_out``."""

    def __init__(self, seed: int = 3) -> None:
        super().__init__(seed=seed)
        self.gdn = GDNWeights(self.dim)

    # plain decoding: the whole model token by token, recurrent state carried along ------------
    def initial_state(self) -> tuple[Tensor, Tensor]:
        return torch.zeros(C, W - 1), torch.zeros(HV, KD, VD)

    def gdn_step(self, x: Tensor, window: Tensor, state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        mixed, a, b = self.gdn.inputs(x)
        conv_out, window = gdn.conv_step(window, mixed, self.gdn.conv, self.gdn.bias)
        q, k, v = gdn.split_qkv(conv_out, H, HV, KD, VD)
        g, beta = gdn.gates(self.gdn.A_log, a, self.gdn.dt_bias, b)
        out, state = gdn.delta_step(state, q, k, v, g, beta)
        return x + out.reshape(-1).to(DTYPE) @ self.gdn.w_out, window, state

    def mixed_rows(self, tokens: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """Residual stream after the GDN layer for every position of a plain token list, and the
        recurrent state (window, state) after the last token."""
        window, state = self.initial_state()
        rows = []
        x = self._x(torch.tensor(tokens), torch.arange(len(tokens)))
        for i in range(len(tokens)):
            y, window, state = self.gdn_step(x[i], window, state)
            rows.append(y)
        return torch.stack(rows), window, state

    def head_mixed(self, x: Tensor, y: Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """One row after the GDN layer: query from ``y``, logits from [attention, y]; the hidden
        row handed to the drafter keeps the input embedding ``x`` (the toy drafter reads its
        context tokens back from it, see ToyTarget.token_of)."""
        att = torch.softmax(keys @ (y @ self.wq) / self.dim**0.5, dim=0) @ values
        return torch.cat([att, y]) @ self.out, torch.cat([att, x])

    def reference_logits(self, tokens: list[int]) -> Tensor:
        y, _, _ = self.mixed_rows(tokens)
        x = self._x(torch.tensor(tokens[-1:]), torch.tensor([len(tokens) - 1]))[0]
        logits, _ = self.head_mixed(x, y[-1], y, y @ self.wv)
        return logits

    def kv_rows_mixed(self, y: Tensor) -> tuple[Tensor, Tensor]:
        return y, y @ self.wv


class VerifyForwardBatch(SimpleNamespace):
    """The ForwardBatch fields of a TARGET_VERIFY that the GDN backend reads; every optional
    feature it probes (mamba tracking, multi-item scoring, ragged layouts, ...) reads as None."""

    def __getattr__(self, name: str) -> None:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class HybridToyModels(ToyModels):
    """``tree_round.RoundModels`` for the hybrid toy: the verify's GDN layer runs through SGLang's
    backend in tree mode (``graph_sites.linear_backend_tree_hook``) with the plugin's tree input
    (``ddtree_info.DDTreeVerifyInput``), exactly as ``sglang_models.SGLangRoundModels.target_verify``
    hands them to the model runner."""

    def __init__(self, target: HybridToyTarget, req_to_token, target_kv, draft_kv, *, pool, backend, noise):
        super().__init__(target, req_to_token, target_kv, draft_kv, noise=noise)
        self.pool, self.backend = pool, backend
        self.verifies = 0

    def prefill(self, req_pool_idx: int, prompt: list[int]) -> int:
        """The prompt's KV, drafter context and recurrent state (prefill is DFlash's code in the
        server; here the plain recurrence writes the state into the request's mamba slot)."""
        n = len(prompt)
        loc = self.req_to_token[req_pool_idx, :n]
        y, window, state = self.target.mixed_rows(prompt)
        x = self.target._x(torch.tensor(prompt), torch.arange(n))
        k, v = self.target.kv_rows_mixed(y)
        self.target_kv.set_kv_buffer(None, loc.long(), k.unsqueeze(1), v.unsqueeze(1), layer_id_override=0)
        keys, values = self.target_kv.get_key_buffer(0)[:, 0], self.target_kv.get_value_buffer(0)[:, 0]
        seen = [loc[: i + 1].long() for i in range(n)]
        rows = [self.target.head_mixed(x[i], y[i], keys[seen[i]], values[seen[i]]) for i in range(n)]
        logits, hidden = zip(*rows, strict=True)
        slot = int(self.pool.get_mamba_indices(torch.tensor([req_pool_idx]))[0])
        cache = self.pool.mamba_pool.mamba_cache
        cache.conv[0][GDN_LAYER, slot] = window
        cache.temporal[GDN_LAYER, slot] = state.transpose(-1, -2)  # SGLang's [HV, V, K]
        self.write_draft_context(torch.stack(hidden), loc.long(), torch.arange(n))
        return int(torch.stack(logits)[-1].argmax())

    def target_verify(self, plan, cache_loc: Tensor, req_pool_indices: Tensor):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        from ddtree_runtime.sglang_plugin.ddtree_info import DDTreeVerifyInput

        b, rows = plan.candidates.shape
        verify = DDTreeVerifyInput(
            draft_token=plan.draft_token, positions=plan.positions, draft_token_num=rows,
            custom_mask=plan.custom_mask, retrieve_next_token=plan.retrieve_next_token,
            retrieve_next_sibling=plan.retrieve_next_sibling,
        )
        fb = VerifyForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, logical_forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=b, req_pool_indices=req_pool_indices, input_ids=plan.draft_token,
            spec_info=verify, mamba_track_indices=None, mamba_track_mask=None,
        )
        x = self.target._x(plan.draft_token, plan.positions)
        mixed, a, bgate = self.target.gdn.inputs(x)
        self.backend.init_forward_metadata(fb)
        out = self.backend.forward(
            layer=self.target.gdn.layer(), forward_batch=fb, mixed_qkv=mixed, a=a, b=bgate
        )
        self.verifies += 1
        y = x + out.reshape(b * rows, HV * VD).to(DTYPE) @ self.target.gdn.w_out
        return self._attend(plan, x, y, cache_loc, req_pool_indices)

    def _attend(self, plan, x: Tensor, y: Tensor, cache_loc: Tensor, req_pool_indices: Tensor):
        b, rows = plan.candidates.shape
        k, v = self.target.kv_rows_mixed(y)
        loc = cache_loc.long()
        self.target_kv.set_kv_buffer(None, loc, k.unsqueeze(1), v.unsqueeze(1), layer_id_override=0)
        keys, values = self.target_kv.get_key_buffer(0)[:, 0], self.target_kv.get_value_buffer(0)[:, 0]
        out_logits, out_hidden, offset = [], [], 0
        for r in range(b):
            prefix = int(plan.positions.view(b, rows)[r, 0])
            cols = prefix + rows
            mask = plan.custom_mask[offset : offset + rows * cols].view(rows, cols)
            offset += rows * cols
            prefix_slots = self.req_to_token[int(req_pool_indices[r]), :prefix]
            slots = torch.cat([prefix_slots, cache_loc.view(b, rows)[r]])
            for i in range(rows):
                s = slots[mask[i]].long()
                row = r * rows + i
                logits, hidden = self.target.head_mixed(x[row], y[row], keys[s], values[s])
                out_logits.append(logits)
                out_hidden.append(hidden)
        return torch.stack(out_logits), torch.stack(out_hidden)
