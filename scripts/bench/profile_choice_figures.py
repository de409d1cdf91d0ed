"""The projection table of ``docs/bench/profile-choice.md``, from ``ddtree tune``'s round-cost model.

    .venv/bin/python scripts/bench/profile_choice_figures.py

Tokens per round per setting from the lab hybrid pair's ``bench_summary`` lines (the same lines
``tests/unit/test_profile_choice.py`` reads), round costs from ``planner/tune.round_ms``; every setting
is priced here whether or not it fits (the profile table, which the test pins, prices only those that do).
"""

from __future__ import annotations

from pathlib import Path

from ddtree_runtime.planner.profile_choice import LAB_HYBRID_SERVERS, lab_tokens_per_round
from ddtree_runtime.planner.tune import CHAIN, round_ms

REPO = Path(__file__).resolve().parents[2]
FIGURES = REPO / "docs/bench/2026-12-01-h200-gpu-lab-bench-hybrid.jsonl"
SERVERS = LAB_HYBRID_SERVERS
POINTS = (("H200", 1, (1, 4, 8, 16)), ("A6000", 2, (1, 4, 8)))


def tokens_per_round() -> dict[str, float]:
    return lab_tokens_per_round(FIGURES.read_text().splitlines())


def main() -> int:
    tpr = tokens_per_round()
    print("accept length (lab hybrid pair): " + ", ".join(f"{k} {v:g}" for k, v in tpr.items()))
    print()
    head = ("GPU", "concurrency", "chain", "budget 16", "budget 32", "16 / chain", "32 / chain")
    print("| " + " | ".join(head) + " | break-even gain for 16 |")
    print("|---|---|---|---|---|---|---|---|")
    for gpu, tp, points in POINTS:
        for c in points:
            ms = {label: round_ms(label, c, gpu=gpu, tp=tp) for label in SERVERS}
            tps = {label: c * tpr[label] / ms[label] * 1e3 for label in SERVERS}
            cells = [f"{ms[label]:.1f} / {tps[label]:.0f}" for label in SERVERS]
            print(
                f"| {tp}x{gpu} | {c} | " + " | ".join(cells) + f" | {tps['16'] / tps[CHAIN]:.2f}x"
                f" | {tps['32'] / tps[CHAIN]:.2f}x | {ms['16'] / ms[CHAIN]:.2f} |"
            )
    print()
    print(
        f"lab hybrid pair's gain for 16: {tpr['16'] / tpr[CHAIN]:.3f}x, for 32: {tpr['32'] / tpr[CHAIN]:.3f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
