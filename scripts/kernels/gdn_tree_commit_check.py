"""SGLang 0.5.23's tree verify and commit for GDN layers on a CUDA device, fed DDTree's trees and walks:
the step the CPU tests cannot run (SGLang's scatter kernels are CUDA/XPU only).

Per case (Qwen3.6-27B's GDN head shapes, several requests in scattered pool slots, two layers):
SGLang's conv and recurrent tree kernels verify our ``build_tree`` trees into the dense per-row scratch;
each request accepts a random root path (a leaf's, cut at a random length, as stop truncation does);
SGLang's ``fused_commit_track_indices`` (the GPU branch of ``_verify_commit_step_indices``) turns our
``accept_index`` into node rows and the mamba-track crossing rows; ``scatter_mamba_states_after_mtp_verify``
copies them into the pool (request slots and track slots). Checked: the rows equal the eager formula and
the accepted / crossing node; the committed slots equal the scratch rows bit for bit and the plain
recurrence (``ddtree_runtime.tiny_engine.gdn``) token by token along the accepted path; and the chain
layout of the conv scratch (SGLang's choice for top-k <= 1) commits wrong windows for the same trees.

    PYTHONPATH=<carried sglang kernels>:. python scripts/kernels/gdn_tree_commit_check.py

One JSON line per case; exit 1 when a check fails.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch

from ddtree_runtime.tiny_engine import gdn

H, HV, K, V, W = 16, 48, 128, 128, 4
C = 2 * H * K + HV * V
LAYERS = 2


def _case(seed: int, ssm_dtype: torch.dtype, budget: int, slots: list[int], track: list[int], dedup: bool):
    from sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent import (
        fused_sigmoid_gating_delta_rule_update,
    )
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_update
    from sglang.kernels.ops.mamba.mamba_state_scatter_triton import (
        fused_commit_track_indices,
        scatter_mamba_states_after_mtp_verify,
    )

    from ddtree_runtime.core.tree import build_tree, compile_tree

    dev = "cuda"
    g = torch.Generator().manual_seed(seed)
    b, t, pool = len(slots), budget + 1, max(slots + track) + 2
    steps = max(t, 16)
    tree = build_tree(torch.randn(b, 15, 500, generator=g) * 5.0, budget)  # peaked: deep paths
    inputs = compile_tree(tree, torch.zeros(b, dtype=torch.long), torch.full((b,), 100))
    nxt, sib = inputs.retrieve_next_token.to(dev), inputs.retrieve_next_sibling.to(dev)
    parents = tree.parents

    def rnd(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(dev)

    conv_pool = rnd(LAYERS, pool, C, W - 1)
    ssm_pool = rnd(LAYERS, pool, HV, V, K, scale=0.1, dtype=ssm_dtype)
    conv0, ssm0 = conv_pool.clone(), ssm_pool.clone()
    inter_ssm = torch.zeros(LAYERS, b + 1, steps, HV, V, K, dtype=ssm_dtype, device=dev)
    if dedup:  # memory_pool.MambaPool._allocate_deduplicated_conv_window
        phys = torch.zeros(LAYERS, b + 1, C, steps + W - 2, dtype=torch.bfloat16, device=dev)
        s = phys.stride()
        inter_conv = phys.as_strided((LAYERS, b + 1, steps, C, W - 1), (s[0], s[1], s[3], s[2], s[3]))
    else:
        inter_conv = torch.zeros(LAYERS, b + 1, steps, C, W - 1, dtype=torch.bfloat16, device=dev)
    slot_t = torch.tensor(slots, dtype=torch.int32, device=dev)
    rows_t = torch.arange(b, dtype=torch.int32, device=dev)
    cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=dev)
    layers = []
    for layer in range(LAYERS):
        lw = SimpleNamespace(
            mixed=rnd(b * t, C), weight=rnd(C, W, scale=0.5), A_log=rnd(HV, scale=0.5, dtype=torch.float32),
            dt_bias=rnd(HV, scale=0.5, dtype=torch.float32), a=rnd(b * t, HV), b=rnd(b * t, HV),
        )  # fmt: skip
        parent = torch.empty_like(nxt)
        conv_out = causal_conv1d_update(
            lw.mixed.view(b, t, C).transpose(1, 2), conv_pool[layer], lw.weight, None, "silu",
            conv_state_indices=slot_t, intermediate_conv_window=inter_conv[layer],
            intermediate_state_indices=rows_t, retrieve_next_token=nxt, retrieve_next_sibling=sib,
            retrieve_parent_token=parent,
        ).transpose(1, 2).reshape(b * t, C)  # fmt: skip
        q, k, v = torch.split(conv_out, [H * K, H * K, HV * V], dim=-1)
        fused_sigmoid_gating_delta_rule_update(
            A_log=lw.A_log, dt_bias=lw.dt_bias, q=q.reshape(1, b * t, H, K), k=k.reshape(1, b * t, H, K),
            v=v.reshape(1, b * t, HV, V), a=lw.a, b=lw.b, initial_state_source=ssm_pool[layer],
            initial_state_indices=slot_t, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, softplus_beta=1.0,
            softplus_threshold=20.0, disable_state_update=True,
            intermediate_states_buffer=inter_ssm[layer], intermediate_state_indices=rows_t, cache_steps=t,
            retrieve_parent_token=parent,
        )  # fmt: skip
        lw.conv_out = conv_out.view(b, t, C)
        layers.append(lw)

    # each request accepts a leaf's path cut at a random length (stop truncation), as our walk reports it
    accept = torch.full((b, tree.horizon + 1), -1, dtype=torch.long)
    lens, paths = torch.zeros(b, dtype=torch.long), []
    for r in range(b):
        real = [0] + [i for i in range(1, t) if int(parents[r, i]) >= 0]
        leaves = [i for i in real if i not in {int(parents[r, j]) for j in real if j > 0}]
        node, path = leaves[int(torch.randint(len(leaves), (1,), generator=g))], []
        while node >= 0:
            path.append(node)
            node = int(parents[r, node]) if node else -1
        path = path[::-1][: int(torch.randint(max(1, len(path) - 2), len(path) + 1, (1,), generator=g))]
        accept[r, : len(path)] = torch.tensor(path) + r * t
        lens[r] = len(path)
        paths.append(path)
    interval = 4
    seq_lens = torch.randint(90, 110, (b,), generator=g)
    rows, track_rows = fused_commit_track_indices(accept.to(dev), lens.to(dev), seq_lens.to(dev), t, interval)
    rows, track_rows = rows.cpu(), track_rows.cpu()
    # SGLang's eager formula (the CPU branch of _verify_commit_step_indices)
    offset = torch.arange(0, b * t, t)
    eager_rows = accept[torch.arange(b), lens - 1] - offset
    crossing = seq_lens // interval != (seq_lens + lens) // interval
    ith = torch.clamp((seq_lens + lens) // interval * interval - seq_lens - 1, min=0)
    eager_track = torch.where(crossing, accept[torch.arange(b), ith] - offset, -1)

    caches = SimpleNamespace(temporal=ssm_pool, intermediate_ssm=inter_ssm, conv=[conv_pool],
                             intermediate_conv_window=[inter_conv])  # fmt: skip
    track_t = torch.tensor(track, dtype=torch.int64, device=dev)
    scatter_mamba_states_after_mtp_verify(caches, slot_t, rows.to(dev), track_t, track_rows.to(dev))
    torch.cuda.synchronize()

    exact, ref_err, window_err = True, 0.0, 0.0
    for r in range(b):
        node, path = int(rows[r]), paths[r]
        for layer, lw in enumerate(layers):
            exact &= torch.equal(ssm_pool[layer, slots[r]], inter_ssm[layer, r, node])
            exact &= torch.equal(conv_pool[layer, slots[r]], inter_conv[layer, r, node])
            if int(track_rows[r]) >= 0:
                exact &= torch.equal(ssm_pool[layer, track[r]], inter_ssm[layer, r, int(track_rows[r])])
            window, state = conv0[layer, slots[r]].float(), ssm0[layer, slots[r]].float().transpose(-1, -2)
            mixed, a_in, b_in = lw.mixed.view(b, t, C), lw.a.view(b, t, HV), lw.b.view(b, t, HV)
            for n in path:  # the plain recurrence, token by token along the accepted path
                _, window = gdn.conv_step(window, mixed[r, n].float(), lw.weight.float(), None)
                qn, kn, vn = gdn.split_qkv(lw.conv_out[r, n].float(), H, HV, K, V)
                gg, beta = gdn.gates(lw.A_log, a_in[r, n], lw.dt_bias, b_in[r, n])
                _, state = gdn.delta_step(state, qn, kn, vn, gg, beta)
            got = ssm_pool[layer, slots[r]].float().transpose(-1, -2)
            ref_err = max(ref_err, ((got - state).abs().max() / state.abs().max()).item())
            window_err = max(window_err, (conv_pool[layer, slots[r]].float() - window).abs().max().item())
    layout, dtype_name = "dedup" if dedup else "dense", str(ssm_dtype).replace("torch.", "")
    return {
        "case": f"seed{seed}-{layout}-B{budget}-{dtype_name}",
        "requests": b,
        "accept_lens": lens.tolist(),
        "tracked": int((track_rows >= 0).sum()),
        "rows_are_the_accepted_nodes": rows.tolist() == [p[-1] for p in paths],
        "rows_match_eager_formula": torch.equal(rows, eager_rows) and torch.equal(track_rows, eager_track),
        "commit_copies_the_scratch_rows": bool(exact),
        "state_vs_plain_recurrence_rel_err": round(ref_err, 5),
        "window_vs_plain_max_err": window_err,
    }


def main() -> int:
    ok = True
    cases = [
        (0, torch.float32, 64, [7, 2, 5, 4], [8, 9, 3, 1], False),
        (1, torch.bfloat16, 16, [3, 6, 1], [8, 2, 4], False),
        (2, torch.float32, 64, [7, 2, 5, 4], [8, 9, 3, 1], True),
    ]
    for seed, dtype, budget, slots, track, dedup in cases:
        try:
            row = _case(seed, dtype, budget, slots, track, dedup)
        except Exception as exc:  # report and go on: one failed case must not hide the others
            row = {"case": f"seed{seed}", "error": f"{type(exc).__name__}: {exc}"}
            ok = False
        else:
            good = row["rows_are_the_accepted_nodes"] and row["rows_match_eager_formula"]
            good &= row["commit_copies_the_scratch_rows"]
            if dedup:  # the chain layout: wrong conv windows for a tree
                row["dedup_commits_wrong_windows"] = row["window_vs_plain_max_err"] > 0
                good &= row["dedup_commits_wrong_windows"]
            else:
                good &= row["window_vs_plain_max_err"] == 0
                good &= row["state_vs_plain_recurrence_rel_err"] < 2e-2
            row["ok"] = bool(good)
            ok &= bool(good)
        print(json.dumps(row), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
