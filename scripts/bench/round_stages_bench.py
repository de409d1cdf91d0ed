"""The tree round's stages between the drafter and the verify and after it (``round_graphs``), eager
against replayed from the bucket's CUDA graphs, at a real model's head shape (Qwen3.6-27B-DFlash:
hidden 5120, vocabulary 248320, block 16). One JSON line per (batch, budget, mode):

* ``host_us``: median time the host spends issuing one round's two stages (no sync inside);
* ``wall_us``: median time of one round, host and GPU, synchronised after it.

Run on the device: ``bash scripts/lab/gpu/device.sh python scripts/bench/round_stages_bench.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ddtree_runtime.sglang_plugin.round.round_graphs import GraphSpec, RoundGraphs
from ddtree_runtime.sglang_plugin.round.tree_round import RoundConfig, RoundInput

DEV = torch.device("cuda")


class TorchKV:
    """64 attention layers' worth of K/V rows moved by one gather/scatter (a stand-in for SGLang's
    fused ``move_kv_cache``; its cost is the same in both modes)."""

    def __init__(self, slots: int) -> None:
        self.k = torch.zeros((slots, 16, 128), dtype=torch.bfloat16, device=DEV)

    def move_kv_cache(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.k[dst] = self.k[src]


def bench(batch: int, budget: int, vocab: int, hidden: int, rounds: int) -> list[dict]:
    cfg = RoundConfig(budget=budget, block_size=16, mask_token_id=0, page_size=1)
    weight = (torch.randn((vocab, hidden), device=DEV) / hidden**0.5).to(torch.bfloat16)
    rows, context = cfg.verify_rows, 4096
    lines = []
    for mode in ("eager", "graph"):
        spec = GraphSpec(
            cfg=cfg,
            head=lambda h: torch.matmul(h.to(weight.dtype), weight.t()).float(),
            hidden_size=hidden,
            hidden_dtype=torch.bfloat16,
            kv_pool=TorchKV(65536),
            mask_buffer=torch.zeros(
                batch * cfg.write_window * (context + cfg.write_window), dtype=torch.bool, device=DEV
            ),
            mask_max_bs=batch,
        )
        graphs = RoundGraphs(spec, DEV, capture=(mode == "graph"))
        graphs.build([batch])
        depth = torch.randn((batch, 15, hidden), device=DEV).to(torch.bfloat16)
        root = torch.randint(0, vocab, (batch,), device=DEV)
        prefix = torch.full((batch,), 1000, device=DEV)
        slots = torch.arange(1, 1 + batch * cfg.write_window, device=DEV).view(batch, -1)
        posterior = torch.randint(0, vocab, (batch * rows,), device=DEV)
        stops = tuple(frozenset({2}) for _ in range(batch))
        inp = RoundInput(
            req_pool_indices=torch.arange(batch, device=DEV), prefix_lens=prefix, bonus_tokens=root
        )
        cells = rows * (batch * 1000 + rows * batch)
        host, wall = [], []
        for i in range(rounds + 5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            bucket = graphs.plan_stage(batch, inp)
            bucket.plan(depth, root, prefix, cells)
            bucket.accept(posterior, slots, stops)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            if i >= 5:
                host.append((t1 - t0) * 1e6)
                wall.append((t2 - t0) * 1e6)
        lines.append({
            "bench": "round_stages", "mode": mode, "batch": batch, "budget": budget, "vocab": vocab,
            "hidden": hidden, "rounds": rounds, "host_us": round(statistics.median(host), 1),
            "wall_us": round(statistics.median(wall), 1),
        })  # fmt: skip
    eager, graph = lines
    graph["host_vs_eager"] = round(graph["host_us"] / eager["host_us"], 3)
    graph["wall_vs_eager"] = round(graph["wall_us"] / eager["wall_us"], 3)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1 4 16")
    parser.add_argument("--budgets", default="15 16 32")
    parser.add_argument("--vocab", type=int, default=248320)
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    with torch.no_grad():
        for batch in (int(b) for b in args.batches.split()):
            for budget in (int(b) for b in args.budgets.split()):
                for line in bench(batch, budget, args.vocab, args.hidden, args.rounds):
                    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
