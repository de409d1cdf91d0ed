"""`ddtree tiny-engine make-models | serve | bench` (host side; torch is imported inside the handlers)."""

from __future__ import annotations

import argparse
import json
import sys

from ddtree_runtime.tiny_engine.bench import add_bench_args
from ddtree_runtime.tiny_engine.server_args import add_server_args


def _make_models(args: argparse.Namespace) -> int:
    from ddtree_runtime.tiny_engine.make import make_models

    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    summary = make_models(args.dir, seed=args.seed, kind=args.kind, log=log)
    print(json.dumps(summary))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from ddtree_runtime.tiny_engine.server import serve

    return serve(args)


def _bench(args: argparse.Namespace) -> int:
    from ddtree_runtime.tiny_engine.bench import bench_main

    return bench_main(args)


def register(subparsers: argparse._SubParsersAction, *, listed: bool = True) -> None:
    """The verbs under ``subparsers``; ``listed=False`` leaves them out of the group's help (an old
    spelling kept working)."""

    def add_parser(name: str, **kwargs: str) -> argparse.ArgumentParser:
        if not listed:
            kwargs.pop("help", None)  # argparse lists a sub-command only when it has a help text
        return subparsers.add_parser(name, **kwargs)

    p = add_parser(
        "make-models",
        help="write the tiny lab models (DIR/target, DIR/draft, DIR/draft-mismatched)",
        description="Train a tiny Qwen3-style target on the lab language and distil a DFlash-style drafter "
        "on it; deterministic for a given --seed. --kind hybrid makes the target a Qwen3.5-style hybrid "
        "(Gated DeltaNet layers, then an attention layer).",
    )
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kind", choices=["dense", "hybrid"], default="dense", help="target kind (default dense)")
    p.set_defaults(func=_make_models)

    p = add_parser(
        "serve",
        help="the tiny engine behind SGLang's HTTP surface (SGLang launch flags)",
        description="Serve the lab models with SGLang's launch flags and endpoints. Faults: DDTREE_LAB_FAULT="
        "capture_predicate|hidden_none|slow_start|crash_after_start. Notional device memory for "
        "--mem-fraction-static: DDTREE_LAB_DEVICE_MEMORY_MB (default 128).",
    )
    add_server_args(p)
    p.set_defaults(func=_serve)

    p = add_parser(
        "bench",
        help="tokens/s and acceptance length of AR, DFlash and DDTree on the lab models (JSON lines)",
    )
    add_bench_args(p)
    p.set_defaults(func=_bench)
