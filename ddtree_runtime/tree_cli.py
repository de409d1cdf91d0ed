"""`ddtree tree demo` and `ddtree contract check`: the tree round and the handshake, from the shell."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

# A toy vocabulary so the demo reads as words, not ids.
# fmt: off
_WORDS = (
    "the", "a", "of", "to", "and", "in", "is", "that", "it", "for", "on", "with", "as", "was", "at",
    "by", "be", "this", "from", "or", "an", "are", "not", "have", "but", "his", "they", "which", "one",
    "you", "had", "were", "her", "all", "she", "there", "would", "their", "we", "him", "been", "has",
    "when", "who", "will", "more", "no", "if", "out", "so", "said", "what", "up", "its", "about",
    "into", "than", "them", "can", "only", "other", "new", "some", "could", "time",
)
# fmt: on


def register(subparsers: argparse._SubParsersAction) -> None:
    tree = subparsers.add_parser("tree", help="build and show a DDTree from a drafter's logits")
    tree_sub = tree.add_subparsers(dest="tree_command", metavar="TREE_COMMAND")
    tree.set_defaults(func=lambda _args: (tree.print_help(), 2)[1])
    demo = tree_sub.add_parser(
        "demo",
        help="build a tree from seeded draft logits, print it and a greedy walk",
        description="Builds one DDTree round on CPU from seeded, peaked draft logits over a toy "
        "vocabulary, prints the nodes (best-first), and walks it against a toy target.",
    )
    demo.add_argument("--budget", type=int, default=12, help="non-root nodes B (default 12)")
    demo.add_argument("--horizon", type=int, default=5, help="draft horizon L = block_size - 1 (default 5)")
    demo.add_argument(
        "--vocab", type=int, default=len(_WORDS), help=f"vocabulary size (default {len(_WORDS)})"
    )
    demo.add_argument("--topk-cap", type=int, default=None, help="cap on candidates per depth (1 = chain)")
    demo.add_argument("--seed", type=int, default=1)
    demo.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    demo.set_defaults(func=_demo)

    bench = tree_sub.add_parser(
        "bench",
        help="time build/compile/walk on this machine; JSON lines with medians",
        description="Times the tree round's steps on random draft logits and prints one JSON line per "
        "(batch, budget): medians in ms. On CUDA with kernels available, the plain PyTorch path and the "
        "kernels side by side (ratio = plain / kernels).",
    )
    bench.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    bench.add_argument("--batch", default="1,4", help="comma-separated batch sizes (default 1,4)")
    bench.add_argument("--budget", default="16,64,256", help="comma-separated budgets (default 16,64,256)")
    bench.add_argument("--horizon", type=int, default=15)
    bench.add_argument("--vocab", type=int, default=32768)
    bench.add_argument("--repeats", type=int, default=7)
    bench.set_defaults(func=_bench)

    contract = subparsers.add_parser("contract", help="the target/drafter hidden-state contract")
    contract_sub = contract.add_subparsers(dest="contract_command", metavar="CONTRACT_COMMAND")
    contract.set_defaults(func=lambda _args: (contract.print_help(), 2)[1])
    check = contract_sub.add_parser(
        "check",
        help="read both models' files and check the capture width against the drafter's fc",
    )
    check.add_argument("--model-path", required=True, help="target model directory")
    check.add_argument("--draft-model-path", required=True, help="DFlash drafter directory")
    check.add_argument("--json", action="store_true")
    check.set_defaults(func=_contract_check)


def _word(token: int) -> str:
    return _WORDS[token] if 0 <= token < len(_WORDS) else f"<{token}>"


def _demo(args: argparse.Namespace) -> int:
    import torch

    from ddtree_runtime.core.tree import build_tree, compile_tree, walk_greedy

    if args.budget < 0 or args.horizon < 1 or args.vocab < 2:
        print("error: need --budget >= 0, --horizon >= 1, --vocab >= 2", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(args.seed)
    # Peaked draft marginals: a confident favourite per depth, a few runner-ups.
    draft = torch.randn(1, args.horizon, args.vocab, generator=gen)
    picks = torch.randint(0, args.vocab, (2, args.horizon), generator=gen)
    draft[0, torch.arange(args.horizon), picks[1]] += 3.5
    draft[0, torch.arange(args.horizon), picks[0]] += 4.5
    tree = build_tree(draft, args.budget, topk_cap=args.topk_cap)
    prefix = torch.tensor([7])
    root = torch.tensor([0])
    inputs = compile_tree(tree, root, prefix)
    # Toy target: at a node of depth d it follows the drafter's depth-(d+1) marginal, sharpened and
    # perturbed, so it mostly agrees with the spine and sometimes picks a sibling instead.
    rows = args.budget + 1
    depth_of_row = torch.cat([torch.zeros(1, dtype=torch.long), tree.depths[0]])
    target = 3.0 * draft[0, depth_of_row.clamp(max=args.horizon - 1)].unsqueeze(0)
    target = target + 1.5 * torch.randn(1, rows, args.vocab, generator=gen)
    walk = walk_greedy(tree, target)

    n = int(tree.num_nodes[0])
    nodes = [
        {
            "index": i + 1,
            "token": int(tree.tokens[0, i]),
            "word": _word(int(tree.tokens[0, i])),
            "depth": int(tree.depths[0, i]),
            "parent": int(tree.parents[0, i + 1]),
            "score": round(float(tree.scores[0, i]), 4),
            "position": int(inputs.positions[0, i + 1]),
        }
        for i in range(n)
    ]
    k = int(walk.num_accepted[0])
    result: dict[str, Any] = {
        "budget": args.budget,
        "horizon": args.horizon,
        "vocab": args.vocab,
        "topk_cap": args.topk_cap,
        "num_nodes": n,
        "nodes": nodes,
        "accepted": walk.accepted[0, :k].tolist(),
        "acceptance_length": k,
        "bonus": int(walk.bonus[0]),
        "emitted": walk.emitted[0, :k].tolist(),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"DDTree round: budget B={args.budget}, horizon L={args.horizon}, vocab V={args.vocab}, "
        f"topk_cap={args.topk_cap}; root = '{_word(0)}' at position {int(prefix[0])}"
    )
    print(f"{'node':>4} {'parent':>6} {'depth':>5} {'pos':>4} {'score':>9}  token")
    print(f"{0:>4} {-1:>6} {0:>5} {int(prefix[0]):>4} {0.0:>9.4f}  {_word(0)} (root)")
    for node in nodes:
        indent = "  " * node["depth"]
        print(
            f"{node['index']:>4} {node['parent']:>6} {node['depth']:>5} {node['position']:>4} "
            f"{node['score']:>9.4f}  {indent}{node['word']}"
        )
    path = " -> ".join(str(i) for i in result["accepted"])
    print(f"greedy walk: accepted nodes {path} (acceptance length {k}); bonus '{_word(result['bonus'])}'")
    print("emitted: " + " ".join(_word(t) for t in result["emitted"]))
    return 0


def _bench(args: argparse.Namespace) -> int:
    import os
    import statistics
    import time

    import torch

    from ddtree_runtime.core import kernels
    from ddtree_runtime.core.tree import build_tree, compile_tree, walk_greedy

    try:
        batches = [int(x) for x in args.batch.split(",")]
        budgets = [int(x) for x in args.budget.split(",")]
        device = torch.device(args.device)
        torch.empty(1, device=device)
    except (ValueError, RuntimeError) as exc:
        print(f"error: bad --batch/--budget/--device: {exc}", file=sys.stderr)
        return 2
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def median_ms(fn: Any) -> float:
        fn()
        sync()
        times = []
        for _ in range(max(args.repeats, 1)):
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return round(statistics.median(times) * 1e3, 3)

    saved = os.environ.get("DDTREE_DISABLE_KERNELS")
    paths = ["plain"]
    if device.type == "cuda" and kernels.available():
        paths.append("kernels")
    gen = torch.Generator(device=device).manual_seed(0)
    for b in batches:
        logits = torch.randn(b, args.horizon, args.vocab, device=device, generator=gen)
        for budget in budgets:
            row: dict[str, Any] = {"bench": "tree_round", "device": device.type, "b": b, "L": args.horizon,
                                   "V": args.vocab, "B": budget, "repeats": args.repeats}  # fmt: skip
            for path in paths:
                os.environ["DDTREE_DISABLE_KERNELS"] = "1" if path == "plain" else "0"
                tree = build_tree(logits, budget)
                root = torch.zeros(b, dtype=torch.long, device=device)
                prefix = torch.full((b,), 100, dtype=torch.long, device=device)
                target = torch.randn(b, budget + 1, args.vocab, device=device, generator=gen)
                row[f"{path}_build_ms"] = median_ms(lambda: build_tree(logits, budget))  # noqa: B023
                row[f"{path}_compile_ms"] = median_ms(lambda: compile_tree(tree, root, prefix))  # noqa: B023
                row[f"{path}_walk_greedy_ms"] = median_ms(lambda: walk_greedy(tree, target))  # noqa: B023
            if "kernels" in paths:
                for step in ("build", "compile", "walk_greedy"):
                    kernel_ms = row[f"kernels_{step}_ms"]
                    row[f"{step}_plain_over_kernels"] = (
                        round(row[f"plain_{step}_ms"] / kernel_ms, 2) if kernel_ms else None
                    )
            print(json.dumps(row), flush=True)
    if saved is None:
        os.environ.pop("DDTREE_DISABLE_KERNELS", None)
    else:
        os.environ["DDTREE_DISABLE_KERNELS"] = saved
    return 0


def _contract_check(args: argparse.Namespace) -> int:
    from ddtree_runtime.core.contract import load_contract
    from ddtree_runtime.core.model_files import ContractError

    try:
        contract = load_contract(args.model_path, args.draft_model_path)
    except ContractError as exc:
        if args.json:
            print(json.dumps({"ok": False, "cause": exc.cause, "message": str(exc), "details": exc.details}))
        else:
            print(f"contract check failed ({exc.cause}): {exc}", file=sys.stderr)
        return 1
    data = contract.to_dict()
    if args.json:
        print(json.dumps({"ok": True, "contract": data}))
        return 0
    ids = ", ".join(str(i) for i in contract.target_layer_ids)
    print(
        f"target: hidden {contract.target_hidden_size}, {contract.target_num_layers} layers"
        f"{' (hybrid: linear-attention/mamba layers)' if contract.hybrid else ''}"
    )
    print(
        f"drafter: hidden {contract.draft_hidden_size}, block_size {contract.block_size}, "
        f"mask_token_id {contract.mask_token_id}, captures target layers [{ids}]"
    )
    print(
        f"capture width {contract.capture_width} = {len(contract.target_layer_ids)} x "
        f"{contract.target_hidden_size} == drafter fc in_features {contract.fc_in_features}: ok"
    )
    for warning in contract.warnings:
        print(f"warning: {warning}")
    return 0
