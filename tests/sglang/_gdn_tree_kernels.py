"""Run by test_hybrid_tree_kernels.py in a child process with TRITON_INTERPRET=1 (set before Triton
decorates SGLang's kernels). Prints one JSON line per case.

SGLang 0.5.23's own GDN tree-verify kernels (``causal_conv1d_update`` with first-child/next-sibling
links, ``fused_sigmoid_gating_delta_rule_update`` with ``retrieve_parent_token``), fed trees from
DDTree's ``build_tree``/``compile_tree``, against the plain PyTorch recurrence decoded token by token
along every root-to-node path. Then SGLang's tree-aware commit (``_verify_commit_step_indices``, CPU
and Triton branches) for every leaf, against token-by-token decoding with SGLang's decode kernels.
"""

from __future__ import annotations

import json
import sys

import torch

from tests.sglang._cpu_env import define_torchvision_op_schemas

define_torchvision_op_schemas()

from sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent import (  # noqa: E402
    fused_sigmoid_gating_delta_rule_update,
)
from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_update  # noqa: E402

from ddtree_runtime.core.tree import build_tree, compile_tree  # noqa: E402
from ddtree_runtime.tiny_engine import gdn  # noqa: E402

H, HV, KD, VD, W = 2, 4, 16, 16, 4  # tiny GDN: 2 q/k heads, 4 value heads, head dim 16, conv width 4
C = 2 * H * KD + HV * VD


class Case:
    """One batch: trees, GDN weights, pools with the requests in scattered slots."""

    def __init__(self, seed: int, slots: list[int], horizon: int, budget: int, topk_cap, peak: float):
        g = torch.Generator().manual_seed(seed)
        self.seed, self.slots_list, self.budget = seed, slots, budget
        b = len(slots)
        vocab = 9
        logits = torch.randn(b, horizon, vocab, generator=g) * peak
        self.tree = build_tree(logits, budget, topk_cap=topk_cap)
        roots = torch.randint(0, vocab, (b,), generator=g)
        self.inputs = compile_tree(self.tree, roots, torch.full((b,), 10))
        self.t = budget + 1
        self.scratch_steps = self.t + 3  # SGLang sizes the scratch max(B+1, block): wider than T
        self.slots = torch.tensor(slots, dtype=torch.int32)
        pool = max(slots) + 2
        self.weight = torch.randn(C, W, generator=g) * 0.5
        self.bias = torch.randn(C, generator=g) * 0.1
        self.A_log = torch.randn(HV, generator=g) * 0.5
        self.dt_bias = torch.randn(HV, generator=g) * 0.5
        self.x = torch.randn(b, self.t, C, generator=g)
        self.a = torch.randn(b, self.t, HV, generator=g)
        self.b = torch.randn(b, self.t, HV, generator=g)
        self.conv_pool = torch.randn(pool, C, W - 1, generator=g)
        self.ssm_pool = torch.randn(pool, HV, VD, KD, generator=g) * 0.3  # SGLang's [HV, V, K]

    @property
    def parents(self) -> torch.Tensor:
        return self.tree.parents

    def real_rows(self, r: int) -> list[int]:
        return [0] + [i for i in range(1, self.t) if int(self.tree.parents[r, i]) >= 0]

    def path(self, r: int, node: int) -> list[int]:
        out = [node]
        while node > 0:
            node = int(self.tree.parents[r, node])
            out.append(node)
        return out[::-1]


def sglang_tree_verify(case: Case, conv_window: torch.Tensor | None = None):
    """The verify SGLang's GDN backend runs for a tree (gdn_backend.forward_extend, TARGET_VERIFY)."""
    b, t = case.x.shape[:2]
    conv_pool = case.conv_pool.clone()
    rows = b + 1  # scratch rows: batch slot i owns row i, plus SGLang's padding row
    if conv_window is None:
        conv_window = torch.zeros(rows, case.scratch_steps, C, W - 1)
    inter_ssm = torch.zeros(rows, case.scratch_steps, HV, VD, KD)
    scratch_rows = torch.arange(b, dtype=torch.int32)
    parent = torch.empty_like(case.inputs.retrieve_next_token)
    mixed = causal_conv1d_update(
        case.x.transpose(1, 2),  # [b, C, T], channel stride 1 as the backend's view
        conv_pool,
        case.weight,
        case.bias,
        "silu",
        conv_state_indices=case.slots,
        intermediate_conv_window=conv_window,
        intermediate_state_indices=scratch_rows,
        retrieve_next_token=case.inputs.retrieve_next_token,
        retrieve_next_sibling=case.inputs.retrieve_next_sibling,
        retrieve_parent_token=parent,
    ).transpose(1, 2)
    q, k, v = gdn.split_qkv(mixed.reshape(b * t, C), H, HV, KD, VD)
    ssm_pool = case.ssm_pool.clone()
    out = fused_sigmoid_gating_delta_rule_update(
        A_log=case.A_log,
        dt_bias=case.dt_bias,
        q=q.unsqueeze(0).contiguous(),
        k=k.unsqueeze(0).contiguous(),
        v=v.unsqueeze(0).contiguous(),
        a=case.a.reshape(b * t, HV),
        b=case.b.reshape(b * t, HV),
        initial_state_source=ssm_pool,
        initial_state_indices=case.slots,
        cu_seqlens=torch.arange(0, (b + 1) * t, t, dtype=torch.int32),
        use_qk_l2norm_in_kernel=True,
        softplus_beta=1.0,
        softplus_threshold=20.0,
        disable_state_update=True,
        intermediate_states_buffer=inter_ssm,
        intermediate_state_indices=scratch_rows,
        cache_steps=t,
        retrieve_parent_token=parent,
    )
    return {
        "parent": parent,
        "conv_out": mixed,
        "out": out.reshape(b, t, HV, VD),
        "windows": conv_window,
        "states": inter_ssm,
        "ssm_pool_after": ssm_pool,
        "conv_pool_after": conv_pool,
    }


def reference_path(case: Case, r: int, path: list[int]):
    """Plain PyTorch, token by token along ``path`` from the committed state of request r."""
    slot = case.slots_list[r]
    window = case.conv_pool[slot]
    state = case.ssm_pool[slot].transpose(-1, -2)  # [HV, K, V]
    for node in path:
        conv_out, window = gdn.conv_step(window, case.x[r, node], case.weight, case.bias)
        q, k, v = gdn.split_qkv(conv_out, H, HV, KD, VD)
        g, beta = gdn.gates(case.A_log, case.a[r, node], case.dt_bias, case.b[r, node])
        out, state = gdn.delta_step(state, q, k, v, g, beta)
    return conv_out, out, window, state.transpose(-1, -2)  # state back in SGLang's [HV, V, K]


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def check_verify(case: Case, got) -> dict:
    parent_ok, errs = True, {"conv_out": 0.0, "out": 0.0, "window": 0.0, "state": 0.0}
    pytorch_tree = pytorch_tree_errors(case, got)
    for r in range(len(case.slots_list)):
        for i in case.real_rows(r):
            if i > 0 and int(got["parent"][r, i]) != int(case.parents[r, i]):
                parent_ok = False
            conv_out, out, window, state = reference_path(case, r, case.path(r, i))
            errs["conv_out"] = max(errs["conv_out"], max_err(got["conv_out"][r, i], conv_out))
            errs["out"] = max(errs["out"], max_err(got["out"][r, i], out))
            errs["window"] = max(errs["window"], max_err(got["windows"][r, i], window))
            errs["state"] = max(errs["state"], max_err(got["states"][r, i], state))
    return {"parents_match": parent_ok, **{f"max_err_{k}": v for k, v in errs.items()}, **pytorch_tree}


def pytorch_tree_errors(case: Case, got) -> dict:
    """Our parent-pointer recurrence (the lab engine's) on the same tree, against SGLang's kernels."""
    b = len(case.slots_list)
    conv_out, windows = gdn.tree_conv(
        case.x, case.conv_pool[case.slots.long()], case.weight, case.bias, case.parents
    )
    q, k, v = gdn.split_qkv(conv_out, H, HV, KD, VD)
    g, beta = gdn.gates(case.A_log, case.a, case.dt_bias, case.b)
    out, states = gdn.tree_delta_rule(
        q, k, v, g, beta, case.ssm_pool[case.slots.long()].transpose(-1, -2), case.parents
    )
    real = torch.zeros(b, case.t, dtype=torch.bool)
    for r in range(b):
        real[r, case.real_rows(r)] = True
    return {
        "lab_tree_max_err_out": max_err(out[real], got["out"][real]),
        "lab_tree_max_err_state": max_err(
            states.transpose(-1, -2)[real], got["states"][:b, : case.t][real]
        ),
        "lab_tree_max_err_window": max_err(windows[real], got["windows"][:b, : case.t][real]),
    }


def leaves(case: Case, r: int) -> list[int]:
    rows = case.real_rows(r)
    has_child = {int(case.parents[r, i]) for i in rows if i > 0}
    return [i for i in rows if i not in has_child]


def accept_index_for(case: Case, nodes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's accept_index [b, L+1] (flat rows, -1 padded) and accept_lens for one accepted node
    per request, as our walk reports them (tree_round: walk.accepted + r * (B+1))."""
    b, t = len(nodes), case.t
    width = case.tree.horizon + 1
    accept = torch.full((b, width), -1, dtype=torch.long)
    lens = torch.zeros(b, dtype=torch.long)
    for r, node in enumerate(nodes):
        path = case.path(r, node)
        accept[r, : len(path)] = torch.tensor(path) + r * t
        lens[r] = len(path)
    return accept, lens


def commit_rows(case: Case, nodes: list[int]) -> dict:
    """SGLang's commit step indices for the accepted node, both branches (CPU eager math; the
    Triton kernel the GPU runs, interpreted here)."""
    from types import SimpleNamespace

    from sglang.kernels.ops.mamba.mamba_state_scatter_triton import fused_commit_track_indices
    from sglang.srt.speculative.spec_utils import _verify_commit_step_indices

    accept, lens = accept_index_for(case, nodes)
    batch = SimpleNamespace(mamba_track_indices=None, seq_lens=torch.full((len(nodes),), 10))
    cpu, _ = _verify_commit_step_indices(
        batch=batch, accept_index=accept, accept_lens=lens, draft_token_num=case.t
    )
    triton_rows, _ = fused_commit_track_indices(accept, lens, None, case.t, 0)
    return {"cpu": cpu.tolist(), "triton": triton_rows.tolist()}


def check_commits(case: Case, got) -> dict:
    """For every leaf of every request: SGLang's commit rows name the leaf, and the committed state
    and window equal token-by-token decoding along the leaf's path."""
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend

    scatter = HybridLinearAttnBackend._scatter_speculative_state_with_mask  # SGLang's CPU scatter
    b = len(case.slots_list)
    per_request = [leaves(case, r) for r in range(b)]
    rounds = max(len(x) for x in per_request)
    rows_ok, state_err, window_err, n = True, 0.0, 0.0, 0
    for j in range(rounds):
        nodes = [ls[j % len(ls)] for ls in per_request]
        rows = commit_rows(case, nodes)
        rows_ok &= rows["cpu"] == nodes and rows["triton"] == nodes
        ssm_pool, conv_pool = case.ssm_pool.clone(), case.conv_pool.clone()
        steps = torch.tensor(rows["cpu"])
        scatter(ssm_pool.unsqueeze(0), got["states"].unsqueeze(0), case.slots, steps)
        scatter(conv_pool.unsqueeze(0), got["windows"].unsqueeze(0), case.slots, steps)
        for r, node in enumerate(nodes):
            _, _, window, state = reference_path(case, r, case.path(r, node))
            slot = case.slots_list[r]
            state_err = max(state_err, max_err(ssm_pool[slot], state))
            window_err = max(window_err, max_err(conv_pool[slot], window))
            n += 1
    return {
        "commit_rows_match": rows_ok,
        "leaves_committed": n,
        "commit_max_err_state": state_err,
        "commit_max_err_window": window_err,
    }


def sglang_decode_along(case: Case, r: int, path: list[int]):
    """SGLang's own decode kernels (T = 1, state updated in place), one token at a time."""
    slot = case.slots[r : r + 1]
    conv_pool, ssm_pool = case.conv_pool.clone(), case.ssm_pool.clone()
    for node in path:
        mixed = causal_conv1d_update(
            case.x[r, node].reshape(1, C, 1), conv_pool, case.weight, case.bias, "silu",
            conv_state_indices=slot,
        ).reshape(1, C)
        q, k, v = gdn.split_qkv(mixed, H, HV, KD, VD)
        fused_sigmoid_gating_delta_rule_update(
            A_log=case.A_log, dt_bias=case.dt_bias,
            q=q.unsqueeze(0).contiguous(), k=k.unsqueeze(0).contiguous(), v=v.unsqueeze(0).contiguous(),
            a=case.a[r, node].reshape(1, HV), b=case.b[r, node].reshape(1, HV),
            initial_state_source=ssm_pool, initial_state_indices=slot,
            cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
            use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0,
        )
    return conv_pool[int(slot)], ssm_pool[int(slot)]


def check_decode_kernels(case: Case, got) -> dict:
    """The deepest leaf of request 0: the tree's committed state equals SGLang's own token-by-token
    decode along that path (same kernels the server decodes with)."""
    node = max(leaves(case, 0), key=lambda i: len(case.path(0, i)))
    window, state = sglang_decode_along(case, 0, case.path(0, node))
    return {
        "decode_path_len": len(case.path(0, node)),
        "decode_max_err_state": max_err(got["states"][0, node], state),
        "decode_max_err_window": max_err(got["windows"][0, node], window),
    }


def check_dedup_layout(case: Case) -> dict:
    """The chain (deduplicated, overlapping) conv-scratch layout SGLang picks for top-k <= 1 on CUDA,
    fed the same tree: how many nodes' windows come out wrong."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.memory_pool import MambaPool

    b = len(case.slots_list)
    pool = SimpleNamespace(conv_window_axis=1, device="cpu")
    _, view = MambaPool._allocate_deduplicated_conv_window(
        pool, conv_shape=(C, W - 1), num_mamba_layers=1, spec_state_size=b,
        speculative_num_draft_tokens=case.scratch_steps, conv_dtype=torch.float32,
    )
    got = sglang_tree_verify(case, conv_window=view[0])
    wrong = 0
    for r in range(b):
        for i in case.real_rows(r):
            _, _, window, _ = reference_path(case, r, case.path(r, i))
            wrong += max_err(got["windows"][r, i], window) > 1e-4
    return {"dedup_wrong_windows": wrong, "nodes": sum(len(case.real_rows(r)) for r in range(b))}


CASES = [
    # name, seed, request slots, horizon L, budget B, top-k cap, logit peak (low = bushy)
    ("bushy-b16-3req", 0, [5, 1, 3], 5, 16, None, 0.7),
    ("deep-b64-2req", 1, [2, 0], 15, 64, None, 2.0),
    ("chain-padded-b12", 2, [4, 1], 7, 12, 1, 1.0),
    ("small-b5", 3, [6], 4, 5, 3, 1.0),
    ("pure-chain-b6", 4, [3], 6, 6, 1, 1.0),  # DFLASH's shape: the one layout the dedup scratch fits
]


if __name__ == "__main__":
    for name, seed, slots, horizon, budget, cap, peak in CASES:
        case = Case(seed, slots, horizon, budget, cap, peak)
        got = sglang_tree_verify(case)
        row = {
            "case": name,
            "budget": budget,
            "requests": len(slots),
            "padded_nodes": int((case.tree.parents[:, 1:] < 0).sum()),
            "max_children": int(
                max((case.tree.parents[r] == p).sum() for r in range(len(slots)) for p in range(case.t))
            ),
            **check_verify(case, got),
            "ssm_pool_untouched": bool(torch.equal(got["ssm_pool_after"], case.ssm_pool)),
            "conv_pool_overwritten": not bool(torch.equal(got["conv_pool_after"], case.conv_pool)),
            **check_commits(case, got),
            **check_dedup_layout(case),
        }
        if name in ("bushy-b16-3req", "chain-padded-b12"):
            row.update(check_decode_kernels(case, got))
        print(json.dumps(row), flush=True)
    sys.stdout.flush()
