"""The drafter's head under TP 2, per decode round, on ONE GPU: bytes, correctness, time.

What a rank of a TP group does per round, before and after issue 25 (``ddtree_runtime.core.tp_head``):

* before: write its shard into a ``-inf`` ``[N, V]`` fp32 tensor, MAX all-reduce it, then the
  tree's top-K + logsumexp over the full vocabulary (the Triton kernel);
* after: top-K of its own shard ``[N, V / 2]`` (the Triton kernel, RAW mode), pack ``[N, 2K + 1]``,
  all-gather, the merge (torch, graph-capturable).

N = batch x 15 depth rows (Qwen3.6-27B-DFlash, block 16), V = 248320. The collectives need two
GPUs: their bytes are printed (arithmetic, ``tp_head_cost``), not timed; on one GPU the other
rank's buffer is computed up front and the all-gather's output holds it. Checks per case: the tree
from the merge = the single-rank kernel tree over the full vocabulary (node for node), the merged
ids = the single-rank top-K ids, both = torch's stable sort of the logits (the order both must
give: logit descending, id ascending; it tells which side is wrong), and a CUDA-graph replay of
the after-path = its eager result.
Times are CUDA-graph replays (median, us); eager medians beside them.

    python scripts/kernels/tp_head_bench.py                            # CUDA, < 60 s
    TRITON_INTERPRET=1 python scripts/kernels/tp_head_bench.py --tiny  # CPU, tiny sizes, same checks

Needs torch, triton and this repository only. One JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, from anywhere

import torch

from ddtree_runtime.core import kernels
from ddtree_runtime.core.kernels.topk import topk_log_probs
from ddtree_runtime.core.tp_head import merge, pack, shard_topk, vocab_shards
from ddtree_runtime.core.tp_head_cost import allreduce_bytes, exchange_bytes, head_rows

HORIZON = 15  # Qwen3.6-27B-DFlash: block 16 -> 15 depth rows per request
VOCAB = 248320


def _same_tree(a: Any, b: Any) -> bool:
    fields = ("tokens", "depths", "parents", "num_nodes")
    same_ints = all(torch.equal(getattr(a, f), getattr(b, f)) for f in fields)
    return same_ints and bool(torch.allclose(a.scores, b.scores, rtol=0, atol=1e-5))


def _cpu_times(fn: Any, iters: int) -> list[float]:
    fn()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e6)
    return out


def _captured(fn: Any) -> Any:
    """``fn``'s outputs from one CUDA-graph replay (warmed up on a side stream, as SGLang captures)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return out, graph


def _median(times: list[float]) -> float:
    return round(statistics.median(times), 2)


def bench_case(batch: int, k: int, world: int, vocab: int, horizon: int, iters: int, cuda: bool) -> dict:
    from ddtree_runtime.bench import _eager_times, _graph_times

    dev = torch.device("cuda" if cuda else "cpu")
    gen = torch.Generator(device=dev).manual_seed(batch * 1000 + k)
    rows = batch * horizon
    shards = vocab_shards(vocab, world)
    logits = torch.randn((rows, vocab), device=dev, generator=gen) * 3
    cut = shards[1].start
    # Tied leaders straddling the shard cut (more than K of them): the smallest ids must win.
    logits[:horizon, max(cut - 2 * k, 0) : cut + 2 * k] = 50.0
    draft = logits.view(batch, horizon, vocab)

    want = kernels.build_tree(draft, k)  # the single-rank kernel path over the full vocabulary
    want_ids = topk_log_probs(draft, k)[1]
    local = [logits[:, s.start : s.start + s.num] for s in shards]
    bufs = [pack(*shard_topk(x, s, k, kernel=True)) for x, s in zip(local, shards, strict=True)]
    gathered = torch.cat(bufs)  # what the all-gather leaves on every rank
    top = merge(gathered, world, k).reshape(batch, horizon)
    got = kernels.build_tree_from_topk(top, k)

    own, own_shard = local[0], shards[0]

    def after() -> Any:  # rank 0's round: its shard, pack, [the all-gather fills `gathered`], merge
        values, ids, sums = shard_topk(own, own_shard, k, kernel=True)
        gathered[:rows].copy_(pack(values, ids, sums))
        return merge(gathered, world, k)

    def before() -> Any:  # rank 0's round before: the -inf [N, V] tensor, [the all-reduce], the top-K
        out = torch.full((rows, vocab), float("-inf"), device=dev)
        out[:, own_shard.start : own_shard.start + own_shard.num] = own
        return topk_log_probs(out.view(batch, horizon, vocab), k)

    stages = {
        "after": after,
        "after_shard_topk": lambda: shard_topk(own, own_shard, k, kernel=True),
        "after_merge": lambda: merge(gathered, world, k),
        "before": before,
        "build_tree_from_topk": lambda: kernels.build_tree_from_topk(top, k),  # the same in both
    }
    row: dict[str, Any] = {
        "bench": "tp_head",
        "tp": world,
        "batch": batch,
        "rows": rows,
        "V": vocab,
        "K": k,
        "trees_equal": _same_tree(got, want),
        "topk_ids_equal": bool(torch.equal(top.ids, want_ids)),
    }
    reference = torch.sort(draft, dim=-1, descending=True, stable=True).indices[..., :k]
    row["reference_ids_equal"] = {
        "single_rank": bool(torch.equal(want_ids, reference)),
        "sharded": bool(torch.equal(top.ids, reference)),
    }
    del reference
    if cuda:
        graph_top, _graph = _captured(after)
        row["graph_replay_equal"] = bool(
            torch.equal(graph_top.ids, top.ids.reshape(rows, k))
            and torch.equal(graph_top.log_probs, top.log_probs.reshape(rows, k))
        )
        row["graph_median_us"] = {name: _median(_graph_times([fn], iters)) for name, fn in stages.items()}
        row["eager_median_us"] = {
            name: _median(_eager_times(fn, max(iters // 2, 5))) for name, fn in stages.items()
        }
    else:
        row["cpu_eager_median_us"] = {name: _median(_cpu_times(fn, iters)) for name, fn in stages.items()}
    row["bytes_per_rank_each_way"] = {
        "before_allreduce": allreduce_bytes(rows, vocab, world),
        "after_allgather": exchange_bytes(rows, k, world),
    }
    return row


def bytes_rows(batches: list[int], ks: list[int], world: int, vocab: int) -> list[dict]:
    """Bytes per round, per rank each way, before / after (arithmetic: printed first, always)."""
    out = []
    for k in ks:
        for batch in batches:
            rows = head_rows(batch, HORIZON + 1)
            before, after = allreduce_bytes(rows, vocab, world), exchange_bytes(rows, k, world)
            out.append({
                "bench": "tp_head_bytes", "tp": world, "batch": batch, "rows": rows, "V": vocab, "K": k,
                "before_allreduce_bytes": before, "after_allgather_bytes": after,
                "before_mb": round(before / 1e6, 2), "after_kb": round(after / 1e3, 2),
                "ratio": round(before / after),
            })
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU-sized cases (V 3001, batch 1 2, K 8 24, L 3)")
    p.add_argument("--batch", type=int, nargs="+", default=None)
    p.add_argument("--k", type=int, nargs="+", default=None, help="top-K (= budget); largest 1023")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--time-limit-s", type=float, default=45.0, help="skip the remaining cases after this")
    args = p.parse_args(argv)
    started = time.monotonic()
    cuda = torch.cuda.is_available() and kernels.available() and not args.tiny
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        error = "no CUDA device: run with TRITON_INTERPRET=1 and --tiny"
        print(json.dumps({"bench": "tp_head", "error": error}))
        return 2
    vocab, horizon = (3001, 3) if args.tiny else (VOCAB, HORIZON)
    batches = args.batch or ([1, 2] if args.tiny else [1, 8, 16])
    ks = args.k or ([8, 24] if args.tiny else [16, 1023, 64])
    iters = args.iters or (2 if args.tiny else 50)
    device = torch.cuda.get_device_name() if cuda else "cpu (TRITON_INTERPRET)"
    print(json.dumps({
        "bench": "tp_head_env", "device": device, "torch": torch.__version__,
        "triton": __import__("triton").__version__, "python": sys.version.split()[0],
    }), flush=True)
    for row in bytes_rows([1, 8, 16], sorted(set(ks)), args.tp, VOCAB):
        print(json.dumps(row), flush=True)
    ok = True
    for k in ks:
        for batch in batches:
            elapsed = time.monotonic() - started
            if elapsed > args.time_limit_s:
                print(json.dumps({"bench": "tp_head", "tp": args.tp, "batch": batch, "K": k,
                                  "skipped": f"time limit {args.time_limit_s} s reached ({elapsed:.0f} s)"}))
                continue
            row = bench_case(batch, k, args.tp, vocab, horizon, iters, cuda)
            row["seconds_so_far"] = round(time.monotonic() - started, 1)
            ok = ok and row["trees_equal"] and row["topk_ids_equal"] and row.get("graph_replay_equal", True)
            ok = ok and all(row["reference_ids_equal"].values())
            print(json.dumps(row), flush=True)
            if cuda:
                torch.cuda.empty_cache()
    print(json.dumps({"bench": "tp_head_done", "all_checks_pass": ok,
                      "seconds": round(time.monotonic() - started, 1)}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
