"""Benchmarks that print one JSON line per case.

``python -m ddtree_runtime.bench tree``: the whole DDTree round (top-K + fp32 logsumexp over the
full vocabulary, tree build, compile, greedy walk over the target logits, commit plan) on the GPU,
Triton kernels (captured in a CUDA graph, replayed) against the plain PyTorch path of
``ddtree_runtime.core.tree`` (eager, with its host syncs) in the same run. Medians and minima in
microseconds; ``identical`` says whether both paths gave the same tree, walk and plan.
``kernel_stages_median_us`` times each launch group in a graph of its own; every such figure
carries the fixed cost of one replay, printed as ``one_tiny_kernel`` (10-20 us on the H200).

Imports only torch, triton and ddtree_runtime.core.tree / .kernels, so it runs on a bare GPU host with
``PYTHONPATH=.``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

# Targets of issue 3 (medians, whole round, one H200): (batch, budget) -> microseconds.
TARGETS_US = {(1, 64): 50.0, (32, 64): 300.0, (1, 1024): 500.0}


def _round(mod: Any, draft: Any, target: Any, roots: Any, prefix: Any, budget: int) -> tuple:
    tree = mod.build_tree(draft, budget)
    verify = mod.compile_tree(tree, roots, prefix)
    walk = mod.walk_greedy(tree, target)
    plan = mod.commit_plan(walk, prefix)
    return tree, verify, walk, plan


def _stages(mod: Any, draft: Any, target: Any, roots: Any, prefix: Any, budget: int) -> dict[str, Callable]:
    """The kernel round cut into its launches, for the per-stage breakdown."""
    import torch

    from ddtree_runtime.core.kernels.build import build_from_topk
    from ddtree_runtime.core.kernels.topk import topk_launches, topk_log_probs

    k = min(budget, draft.shape[-1])
    lp, ids = topk_log_probs(draft, k)
    tree = mod.build_tree(draft, budget)
    walk = mod.walk_greedy(tree, target)
    launches, _, _, _ = topk_launches(draft, k)
    parts = {name: launch for name, launch in launches}  # each needs the ones before it: run in order
    for launch in parts.values():
        launch()
    tiny = torch.zeros(1, device=draft.device)
    return {
        "one_tiny_kernel": lambda: tiny.add_(1),  # the fixed cost of one replayed launch, for scale
        "topk_lse": lambda: topk_log_probs(draft, k),
        **parts,
        "build": lambda: build_from_topk(lp, ids, budget),
        "compile": lambda: mod.compile_tree(tree, roots, prefix),
        "walk": lambda: mod.walk_greedy(tree, target),
        "commit": lambda: mod.commit_plan(walk, prefix),
    }


def _graph_times(fns: list[Callable[[], Any]], iters: int) -> list[float]:
    """Capture each fn in a CUDA graph; replay them round-robin; per-replay microseconds."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:  # warm-up: compile the kernels outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graphs = []
    for fn in fns:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        graphs.append(g)
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        graphs[i % len(graphs)].replay()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends, strict=True)]


def _eager_times(fn: Callable[[], Any], iters: int) -> list[float]:
    import torch

    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) * 1000.0)
    return out


def _same(a: Any, b: Any) -> bool:
    import torch

    if dataclasses.is_dataclass(a):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape:
            return False
        if a.is_floating_point():
            return bool(torch.allclose(a, b, rtol=1e-5, atol=1e-5, equal_nan=True))
        return bool(torch.equal(a, b))
    return a == b


def kernels_topk(draft: Any, budget: int) -> tuple:
    from ddtree_runtime.core.kernels.topk import topk_log_probs

    return topk_log_probs(draft, min(budget, draft.shape[-1]))


def _topk_matches_stable(got: tuple, draft: Any, budget: int) -> bool:
    import torch

    k = min(budget, draft.shape[-1])
    lp = torch.log_softmax(draft.float(), -1)
    order = torch.sort(lp, dim=-1, descending=True, stable=True).indices[..., :k]
    return bool(torch.equal(got[1], order))


def _stats(times: list[float]) -> dict[str, float]:
    return {"median_us": round(statistics.median(times), 2), "min_us": round(min(times), 2)}


def bench_tree_case(
    batch: int, budget: int, horizon: int, vocab: int, iters: int, plain_iters: int, seed: int
) -> dict[str, Any]:
    import torch

    from ddtree_runtime.core import kernels, tree
    from ddtree_runtime.core.kernels.walk import use_lazy_walk

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    set_bytes = batch * (horizon + budget + 1) * vocab * 2
    # Several input sets, replayed round-robin, so that small cases are not timed out of L2.
    n_sets = max(1, min(4, (256 << 20) // max(set_bytes, 1)))

    def inputs() -> tuple:
        draft = (torch.randn((batch, horizon, vocab), device=dev, generator=gen) * 2).to(torch.bfloat16)
        target = (torch.randn((batch, budget + 1, vocab), device=dev, generator=gen) * 2).to(torch.bfloat16)
        roots = torch.randint(0, vocab, (batch,), device=dev, generator=gen)
        prefix = torch.randint(16, 4096, (batch,), device=dev, generator=gen)
        return draft, target, roots, prefix

    sets = [inputs() for _ in range(n_sets)]
    # Make the target follow the draft's argmax chain at most nodes, so that walks go deep.
    for draft, target, _, _ in sets:
        chain = draft.float().argmax(-1)  # [b, L]
        depths = kernels.build_tree(draft, budget).depths
        row_depth = torch.cat([torch.zeros_like(depths[:, :1]), depths], 1).clamp(max=horizon - 1)
        agree = torch.rand(row_depth.shape, device=dev, generator=gen) < 0.8
        boost = torch.where(agree, 30.0, 0.0).unsqueeze(-1).to(target.dtype)
        target.scatter_(2, chain.gather(1, row_depth).unsqueeze(-1), boost)
    fns = [lambda s=s: _round(kernels, s[0], s[1], s[2], s[3], budget) for s in sets]
    kernel_times = _graph_times(fns, iters)

    s0 = sets[0]
    stage_fns = _stages(kernels, s0[0], s0[1], s0[2], s0[3], budget)
    stages = {
        name: round(statistics.median(_graph_times([fn], max(iters // 4, 20))), 2)
        for name, fn in stage_fns.items()
    }

    os.environ["DDTREE_DISABLE_KERNELS"] = "1"
    try:
        plain_times = _eager_times(lambda: _round(tree, s0[0], s0[1], s0[2], s0[3], budget), plain_iters)
        plain_out = _round(tree, *s0, budget)
    finally:
        os.environ.pop("DDTREE_DISABLE_KERNELS", None)
    kernel_out = _round(kernels, *s0, budget)

    lp = torch.log_softmax(s0[0].float(), -1)
    ref_times = _eager_times(lambda: torch.topk(lp, min(budget, vocab), dim=-1), max(plain_iters, 10))

    k_stats, p_stats = _stats(kernel_times), _stats(plain_times)
    row: dict[str, Any] = {
        "bench": "tree",
        "batch": batch,
        "budget": budget,
        "L": horizon,
        "V": vocab,
        "dtype": "bfloat16",
        "kernel_median_us": k_stats["median_us"],
        "kernel_min_us": k_stats["min_us"],
        "plain_median_us": p_stats["median_us"],
        "plain_min_us": p_stats["min_us"],
        "speedup_median": round(p_stats["median_us"] / k_stats["median_us"], 1),
        "kernel_stages_median_us": stages,
        "walk_path": "lazy" if use_lazy_walk(batch, budget, horizon, vocab, 2) else "full",
        "torch_topk_after_log_softmax_us": _stats(ref_times)["median_us"],
        "identical": _same(kernel_out, plain_out),
        # Where they differ: does each path's top-K equal the fully ordered one (stable sort by
        # log-prob, ties by id)? torch.topk may pick any of the tied ids at the K-th place.
        "differs_in": [
            name
            for name, a, b in zip(("tree", "verify", "walk", "plan"), kernel_out, plain_out, strict=True)
            if not _same(a, b)
        ],
        "kernel_topk_is_stable_order": _topk_matches_stable(kernels_topk(s0[0], budget), s0[0], budget),
        "plain_topk_is_stable_order": _topk_matches_stable(
            tree.topk_log_probs(s0[0], min(budget, vocab)), s0[0], budget
        ),
        "mean_accepted": round(float(kernel_out[2].num_accepted.float().mean()), 2),
        "input_sets": n_sets,
        "iters": iters,
        "plain_iters": plain_iters,
    }
    target = TARGETS_US.get((batch, budget))
    if target is not None:
        row["target_us"] = target
        row["meets_target"] = k_stats["median_us"] <= target
    return row


def _tree_main(args: argparse.Namespace) -> int:
    import torch

    from ddtree_runtime.core import kernels

    if not torch.cuda.is_available() or not kernels.available():
        print(json.dumps({"bench": "tree", "error": "needs a CUDA device and Triton"}))
        return 2
    for batch in args.batch:
        for budget in args.budget:
            row = bench_tree_case(
                batch, budget, args.horizon, args.vocab, args.iters, args.plain_iters, args.seed
            )
            row["device"] = torch.cuda.get_device_name()
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    return 0


def _server_main(args: argparse.Namespace) -> int:
    from ddtree_runtime.health.http_client import check_base_url
    from ddtree_runtime.health.server_bench import bench_server

    try:
        url = check_base_url(args.url)
    except ValueError as exc:
        print(f"ddtree bench server: {exc}", file=sys.stderr)
        return 2
    prompts = args.prompt or list(server_prompts())
    summary = bench_server(url, prompts, levels=args.concurrency, requests_per_level=args.requests,
                           repeats=args.repeats, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, label=args.label,
                           warm_each_level=not args.no_level_warmup)  # fmt: skip
    for level, row in summary.items():
        row.pop("ids")
        print(json.dumps({"bench": "server_summary", "server": args.label, "concurrency": level, **row}))
    return 0


def server_prompts() -> tuple[str, ...]:
    """In the lab language (the lab pairs' drafters predict it) and plain text; any server answers them."""
    from ddtree_runtime.health.prompts import CAPITAL, CODE
    from ddtree_runtime.tiny_engine.language import LAB_PROMPTS

    return (*LAB_PROMPTS, CAPITAL, CODE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddtree_runtime.bench", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="which", required=True)
    p = sub.add_parser("tree", help="the whole DDTree round: kernels vs plain path")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--budget", type=int, nargs="+", default=[16, 64, 256, 1024])
    p.add_argument("--horizon", type=int, default=15)
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--plain-iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_tree_main)
    s = sub.add_parser("server", help="a running server over HTTP at fixed concurrency (docs/bench/)")
    s.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:30000")
    s.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    s.add_argument(
        "--requests",
        type=int,
        default=None,
        help="per level (default: 2 x concurrency, and every prompt once)",
    )
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--prompt", action="append", help="a prompt (repeatable; default: a fixed set of 8)")
    s.add_argument("--label", default="", help="names the server in every line")
    s.add_argument(
        "--no-level-warmup",
        action="store_true",
        help="time each level's first pass too (by default it runs once unmeasured: kernels a server "
        "compiles at a new batch size would otherwise be timed as rounds)",
    )
    s.set_defaults(func=_server_main)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
