"""Lab engine benchmark: tokens/s and mean acceptance length for AR, DFlash and DDTree on the lab pairs.

Prints one JSON line per pair and method (median over --repeats runs of the lab prompts as one batch, and
the ratio to AR measured in the same process), so results can be compared side by side across devices.
Both pairs by default: the dense one (Qwen3-style target) and the hybrid one (Qwen3.5-style: Gated
DeltaNet + attention layers), each with its distilled drafter:

    python -m ddtree_runtime.tiny_engine.bench [--models DIR[,DIR]] [--kinds dense,hybrid] [--device cuda]
                                       [--budgets 16,64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _methods(budgets: list[int]) -> list[tuple[str, int | None]]:
    return [("NONE", None), ("DFLASH", None)] + [("DDTREE", b) for b in budgets]


def run_bench(
    models: Path,
    *,
    device: str,
    budgets: list[int],
    max_new_tokens: int,
    repeats: int,
    batch_size: int | None = None,
    prompts: list[str] | None = None,
) -> list[dict]:
    import torch

    from ddtree_runtime.tiny_engine.engine import SamplingParams, TinyEngine
    from ddtree_runtime.tiny_engine.language import LAB_PROMPTS
    from ddtree_runtime.tiny_engine.model_config import load_target_config

    pair = "hybrid" if load_target_config(models / "target").is_hybrid else "dense"
    texts = list(prompts or LAB_PROMPTS)
    if batch_size:
        texts = (texts * (batch_size // len(texts) + 1))[:batch_size]
    rows: list[dict] = []
    ar_tps = None
    for algo, budget in _methods(budgets):
        engine = TinyEngine(
            models / "target",
            models / "draft",
            algorithm=algo,
            budget=budget or 16,
            device=device,
        )
        ids = [engine.tokenizer.encode(t) for t in texts]
        params = [SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)] * len(ids)
        engine.generate(ids[:1], [SamplingParams(max_new_tokens=4)])  # warm-up (allocator, kernels)
        speeds, accepts = [], []
        for _ in range(repeats):
            v0, a0 = engine.stats.verify_ct, engine.stats.accepted_sum
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = engine.generate(ids, params)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            speeds.append(sum(r.completion_tokens for r in out) / seconds)
            v, a = engine.stats.verify_ct - v0, engine.stats.accepted_sum - a0
            accepts.append(a / v if v else 1.0)
        tps = statistics.median(speeds)
        if algo == "NONE":
            ar_tps = tps
        rows.append(
            {
                "bench": "lab_engine",
                "pair": pair,
                "method": {"NONE": "AR"}.get(algo, algo),
                "budget": budget,
                "device": device,
                "batch": len(ids),
                "max_new_tokens": max_new_tokens,
                "repeats": repeats,
                "tokens_per_s_median": round(tps, 2),
                "accept_length_mean": round(statistics.mean(accepts), 3),
                "speedup_vs_ar": round(tps / ar_tps, 3) if ar_tps else None,
            }
        )
    return rows


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=None, help="lab model dirs, comma separated (default: make --kinds)")
    p.add_argument("--kinds", default="dense,hybrid", help="pairs to make when --models is not given")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--budgets", default="16,64", help="DDTree budgets, comma separated")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=None, help="repeat the lab prompts to this many")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")


def bench_main(args: argparse.Namespace) -> int:
    try:
        budgets = [int(b) for b in str(args.budgets).split(",") if b.strip()]
    except ValueError:
        print(f"--budgets {args.budgets!r}: give integers separated by commas, e.g. 16,64", file=sys.stderr)
        return 2
    device = args.device or _default_device()
    import torch

    torch.set_num_threads(args.threads)  # tiny models: one thread is the fastest on CPU
    with tempfile.TemporaryDirectory(prefix="ddtree-lab-bench-") as tmp:
        if args.models:
            dirs = [Path(d) for d in str(args.models).split(",") if d.strip()]
        else:
            from ddtree_runtime.tiny_engine.make import make_models

            dirs = []
            for kind in str(args.kinds).split(","):
                dirs.append(Path(tmp) / kind)
                make_models(dirs[-1], kind=kind, log=lambda msg: print(msg, file=sys.stderr))
        for models in dirs:
            if not (models / "target" / "config.json").exists():
                print(
                    f"{models}/target/config.json not found: run `ddtree tiny-engine make-models {models}`",
                    file=sys.stderr,
                )
                return 2
        for models in dirs:
            rows = run_bench(
                models,
                device=device,
                budgets=budgets,
                max_new_tokens=args.max_new_tokens,
                repeats=args.repeats,
                batch_size=args.batch_size,
            )
            for row in rows:
                print(json.dumps(row), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddtree_runtime.tiny_engine.bench", description=__doc__.splitlines()[0]
    )
    add_bench_args(parser)
    return bench_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
