"""The price of a DDTree verify on Gated DeltaNet layers: SGLang 0.5.23's own GDN verify kernels
(``causal_conv1d_update`` + ``fused_sigmoid_gating_delta_rule_update``, plain Triton) at
Qwen3.6-27B's GDN shapes, per layer and per verify (x 48 GDN layers).

Cases: DFLASH's chain at block 16 (16 rows, no tree links, the deduplicated conv scratch SGLang
gives chains on CUDA) against DDTree trees of budget 16 and 64 (17 / 65 rows, our ``build_tree``'s
first-child / next-sibling links, dense per-row conv scratch); 1 and 8 requests; SSM state in fp32
(SGLang's default ``mamba_ssm_dtype``) and bf16. Every row's SSM state goes to the per-row scratch,
so the bytes written grow with the rows: the figure that decides the budgets worth shipping.

``reuse`` cases run the plugin's recurrence that keeps a parent's state in registers when the parent is
the previous row (``core/kernels/gdn_tree_recurrent.py``, bit-identical to SGLang's; each case checks
it against SGLang's kernel on the same inputs); ``pre`` cases order the tree's rows depth first (each
node's best child right after it), which makes that the case for every first child. ``--sharpness``
scales the random drafter logits (higher: peakier distributions, deeper trees, more first children).

Prints one JSON line per case: medians in microseconds of the two kernels per layer, replayed from
CUDA graphs round-robin over ``--layers`` independent buffer sets (no launch overhead, little L2
reuse), the eager per-layer time (launches included: DDTREE's verify runs eager), per-verify
figures (x 48) and the scratch bytes written per layer.

    python scripts/kernels/gdn_tree_price.py [--batches 1,8] [--configs chain16,tree16,tree64]
    python scripts/kernels/gdn_tree_price.py --configs chain16,tree15,tree15-reuse,tree15-pre-reuse

Without SGLang installed, carry its kernels first (scripts/kernels/carry_gdn_kernels.py).
``--smoke`` runs tiny shapes on CPU under TRITON_INTERPRET=1 (a correctness check of the script).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass

import torch

GDN_LAYERS = 48  # Qwen3.6-27B: 64 layers, 3 of every 4 Gated DeltaNet


@dataclass(frozen=True)
class Shapes:
    hv: int = 48  # value heads
    h: int = 16  # query/key heads
    k: int = 128
    v: int = 128
    w: int = 4  # conv kernel width
    block: int = 16  # drafter block: the scratch is max(B + 1, block) rows
    act: torch.dtype = torch.bfloat16  # activations and conv state (SGLang's default conv dtype)

    @property
    def conv_dim(self) -> int:
        return 2 * self.h * self.k + self.hv * self.v


SMOKE = Shapes(hv=4, h=2, k=16, v=16, w=4, block=4, act=torch.float32)  # the interpreter has no bf16


def tree_links(
    batch: int, budget: int, horizon: int, device: str, seed: int, *,
    sharpness: float = 2.0, preorder: bool = False,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Our tree for random drafter distributions (``sharpness`` scales the logits: 2.0 is fairly
    flat): (first child, next sibling, parents), rows in heap order or depth first."""
    from ddtree_runtime.core.tree import build_tree, compile_tree
    from ddtree_runtime.core.tree_order import depth_first_order, reorder_tree

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, horizon, 1000, generator=g) * sharpness
    tree = build_tree(logits, budget)
    if preorder:
        order = depth_first_order(tree.parents)
        tree = reorder_tree(tree, order)
    inputs = compile_tree(tree, torch.zeros(batch, dtype=torch.long), torch.full((batch,), 100))
    links = (inputs.retrieve_next_token, inputs.retrieve_next_sibling, tree.parents)
    return tuple(x.to(device) for x in links)


def dedup_conv_scratch(slots: int, steps: int, conv_dim: int, w: int, dtype, device) -> torch.Tensor:
    """SGLang's chain layout (memory_pool.MambaPool._allocate_deduplicated_conv_window): one shared
    [conv_dim, steps + w - 2] window per slot, viewed as [slots, steps, conv_dim, w - 1]."""
    phys = torch.zeros(slots, conv_dim, steps + w - 2, dtype=dtype, device=device)
    s0, s1, s2 = phys.stride()
    return phys.as_strided((slots, steps, conv_dim, w - 1), (s0, s2, s1, s2))


class Layer:
    """One GDN layer's buffers for one verify of ``batch`` requests x ``rows`` rows."""

    def __init__(self, shp: Shapes, batch: int, rows: int, tree: bool, ssm_dtype, device, links, seed: int,
                 reuse: bool = False):
        g = torch.Generator(device=device).manual_seed(seed)
        act = shp.act
        c = shp.conv_dim
        steps = max(rows, shp.block)
        slots = batch + 1
        self.rows, self.batch, self.shp, self.reuse = rows, batch, shp, reuse
        self.mixed = torch.randn(batch * rows, c, generator=g, device=device, dtype=act)
        self.weight = torch.randn(c, shp.w, generator=g, device=device, dtype=act) * 0.5
        self.conv_pool = torch.randn(slots, c, shp.w - 1, generator=g, device=device, dtype=act)
        ssm = torch.randn(slots, shp.hv, shp.v, shp.k, generator=g, device=device) * 0.1
        self.ssm_pool = ssm.to(ssm_dtype)
        self.inter_ssm = torch.zeros(slots, steps, shp.hv, shp.v, shp.k, dtype=ssm_dtype, device=device)
        if tree:
            self.inter_conv = torch.zeros(slots, steps, c, shp.w - 1, dtype=act, device=device)
        else:
            self.inter_conv = dedup_conv_scratch(slots, steps, c, shp.w, act, device)
        self.A_log = torch.randn(shp.hv, generator=g, device=device) * 0.5
        self.dt_bias = torch.randn(shp.hv, generator=g, device=device) * 0.5
        self.a = torch.randn(batch * rows, shp.hv, generator=g, device=device, dtype=act)
        self.b = torch.randn(batch * rows, shp.hv, generator=g, device=device, dtype=act)
        self.slots = torch.arange(batch, dtype=torch.int32, device=device)
        self.scratch_rows = torch.arange(batch, dtype=torch.int32, device=device)
        self.cu = torch.arange(0, (batch + 1) * rows, rows, dtype=torch.int32, device=device)
        self.next_token, self.next_sibling, self.tree_parents = links if tree else (None, None, None)
        self.parent = torch.empty_like(self.next_token) if tree else None
        self.conv_out = None

    def conv(self) -> None:
        from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_update

        x = self.mixed.view(self.batch, self.rows, -1).transpose(1, 2)  # the backend's view
        self.conv_out = causal_conv1d_update(
            x, self.conv_pool, self.weight, None, "silu",
            conv_state_indices=self.slots, intermediate_conv_window=self.inter_conv,
            intermediate_state_indices=self.scratch_rows, retrieve_next_token=self.next_token,
            retrieve_next_sibling=self.next_sibling, retrieve_parent_token=self.parent,
        )  # fmt: skip

    def recurrent(self) -> None:
        from sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent import (
            _select_recurrent_launch_config,
            fused_sigmoid_gating_delta_rule_update,
        )

        shp, n = self.shp, self.batch * self.rows
        mixed = self.conv_out.transpose(1, 2).reshape(n, -1)
        q, k, v = torch.split(mixed, [shp.h * shp.k, shp.h * shp.k, shp.hv * shp.v], dim=-1)
        args = dict(
            A_log=self.A_log, dt_bias=self.dt_bias,
            q=q.view(1, n, shp.h, shp.k), k=k.view(1, n, shp.h, shp.k), v=v.view(1, n, shp.hv, shp.v),
            a=self.a, b=self.b, initial_state_source=self.ssm_pool, initial_state_indices=self.slots,
            cu_seqlens=self.cu, softplus_beta=1.0, softplus_threshold=20.0,
            intermediate_states_buffer=self.inter_ssm, intermediate_state_indices=self.scratch_rows,
            retrieve_parent_token=self.parent,
        )  # fmt: skip
        if self.reuse:
            from sglang.kernels.jit.utils import is_arch_support_pdl

            from ddtree_runtime.core.kernels.gdn_tree_recurrent import gdn_tree_verify

            bv, warps = _select_recurrent_launch_config(
                self.batch, shp.h, shp.hv, shp.k, shp.v, False, target_verify=True
            )
            self.rec_out = gdn_tree_verify(**args, block_v=bv, num_warps=warps, use_pdl=is_arch_support_pdl())
        else:
            self.rec_out = fused_sigmoid_gating_delta_rule_update(
                **args, use_qk_l2norm_in_kernel=True, disable_state_update=True, cache_steps=self.rows
            )

    def both(self) -> None:
        self.conv()
        self.recurrent()

    def scratch_bytes_written(self) -> int:
        shp = self.shp
        ssm = self.batch * self.rows * shp.hv * shp.v * shp.k * self.inter_ssm.element_size()
        conv = self.batch * self.rows * shp.conv_dim * (shp.w - 1) * self.inter_conv.element_size()
        return ssm + conv




def parse_config(config: str) -> tuple[int | None, bool, bool, bool]:
    """``chain16`` | ``treeB[-pre][-reuse]`` -> (budget, tree, preorder, reuse)."""
    if config == "chain16":
        return None, False, False, False
    words = config.split("-")
    if not words[0].startswith("tree") or not words[0][4:].isdigit() or set(words[1:]) - {"pre", "reuse"}:
        raise SystemExit(f"unknown config {config!r}: chain16 or treeB[-pre][-reuse], e.g. tree15-pre-reuse")
    return int(words[0][4:]), True, "pre" in words, "reuse" in words


def check_reuse_against_sglang(layer: Layer) -> dict:
    """The reusing recurrence and SGLang's on the same inputs: outputs and scratch rows bit for bit."""
    layer.reuse = False
    layer.both()
    want_out, want_scratch = layer.rec_out.clone(), layer.inter_ssm.clone()
    layer.inter_ssm.zero_()
    layer.reuse = True
    layer.recurrent()
    return {
        "check_reuse_bit_identical": bool(
            torch.equal(layer.rec_out, want_out) and torch.equal(layer.inter_ssm, want_scratch)
        )
    }


def check_against_reference(layer: Layer) -> dict:
    """One fresh run of the kernels against ``ddtree_runtime.tiny_engine.gdn`` (the plain recurrence by parent
    pointer, fp32): conv outputs from the same bf16 inputs, then every row's SSM state and output
    from the kernel's own conv output. Parents as the conv kernel derived them."""
    from ddtree_runtime.tiny_engine import gdn

    shp, b, t = layer.shp, layer.batch, layer.rows
    window0 = layer.conv_pool[: b].clone()
    state0 = layer.ssm_pool[: b].float().transpose(-1, -2)
    layer.both()
    if layer.tree_parents is not None:
        parents = layer.tree_parents
        derived = layer.parent.long()[:, 1:]
        real = parents[:, 1:] >= 0
        parents_match = bool(torch.equal(derived[real], parents[:, 1:][real]))
    else:
        parents, parents_match = gdn.chain_parents(b, t, layer.mixed.device), None
    x = layer.mixed.view(b, t, -1)
    ref_conv, ref_windows = gdn.tree_conv(x.float(), window0.float(), layer.weight.float(), None, parents)
    got_conv = layer.conv_out.transpose(1, 2).float()
    q, k, v = gdn.split_qkv(got_conv, shp.h, shp.hv, shp.k, shp.v)
    g, beta = gdn.gates(layer.A_log, layer.a.view(b, t, -1), layer.dt_bias, layer.b.view(b, t, -1))
    _, ref_states = gdn.tree_delta_rule(q, k, v, g, beta, state0, parents)
    got_states = layer.inter_ssm[:b, :t].float().transpose(-1, -2)
    scale = ref_states.abs().max().item()
    conv_err = (got_conv - ref_conv).abs().max().item() / ref_conv.abs().max().item()
    return {
        "check_parents_match": parents_match,
        "check_conv_max_rel_err": round(conv_err, 5),
        "check_window_max_err": (layer.inter_conv[:b, :t].float() - ref_windows.float()).abs().max().item(),
        "check_state_max_rel_err": round((got_states - ref_states).abs().max().item() / scale, 6),
    }


def run_case(shp: Shapes, config: str, batch: int, ssm_dtype, layers: int, iters: int, device: str,
             sharpness: float = 2.0) -> dict:
    from ddtree_runtime.bench import _eager_times, _graph_times
    from ddtree_runtime.core.kernels.gdn_tree_recurrent import parent_is_previous_fraction

    budget, tree, preorder, reuse = parse_config(config)
    rows = (budget + 1) if tree else shp.block
    links = None
    if tree:
        links = tree_links(
            batch, budget, shp.block - 1, device, seed=batch, sharpness=sharpness, preorder=preorder
        )

    def layer(seed: int, reuse: bool = reuse) -> Layer:
        return Layer(shp, batch, rows, tree, ssm_dtype, device, links, seed=seed, reuse=reuse)

    stack = [layer(i) for i in range(layers)]
    med = statistics.median
    if device == "cuda":
        conv = med(_graph_times([lay.conv for lay in stack], iters))
        rec = med(_graph_times([lay.recurrent for lay in stack], iters))
        both = med(_graph_times([lay.both for lay in stack], iters))
        eager = med(_eager_times(stack[0].both, iters))
    else:  # smoke: run once, no timing
        stack[0].both()
        conv = rec = both = eager = 0.0
    written = stack[0].scratch_bytes_written()
    check = check_against_reference(layer(99))
    if reuse:
        check.update(check_reuse_against_sglang(layer(98, reuse=False)))
    row = {
        "bench": "gdn_tree_price",
        "config": config,
        "budget": budget,
        "rows": rows,
        "batch": batch,
        "preorder": preorder,
        "reuse_parent": reuse,
        "sharpness": sharpness,
        "parent_is_previous": round(parent_is_previous_fraction(links[2].cpu()), 3) if tree else 1.0,
        "ssm_dtype": str(ssm_dtype).replace("torch.", ""),
        "shapes": {"hv": shp.hv, "h": shp.h, "k": shp.k, "v": shp.v, "conv_dim": shp.conv_dim},
        "conv_us": round(conv, 2),
        "recurrent_us": round(rec, 2),
        "layer_us": round(both, 2),
        "layer_eager_us": round(eager, 2),
        "verify_ms": round(both * GDN_LAYERS / 1000, 3),
        "verify_eager_ms": round(eager * GDN_LAYERS / 1000, 3),
        "scratch_mb_per_layer": round(written / 2**20, 2),
        "write_gbps": round(written / (both * 1e-6) / 1e9, 1) if both else None,
        **check,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
    }
    del stack
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8")
    p.add_argument("--configs", default="chain16,tree16,tree64")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--layers", type=int, default=4, help="independent buffer sets replayed round-robin")
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--sharpness", type=float, default=2.0, help="scale of the random drafter logits")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    shp = SMOKE if args.smoke else Shapes()
    for dtype_name in args.dtypes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for config in args.configs.split(","):
                dtype = getattr(torch, dtype_name)
                row = run_case(shp, config, batch, dtype, args.layers, args.iters, device, args.sharpness)
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
