"""Print issue 41's tables (an adaptive server against every fixed budget and DFLASH) from the raw JSON
lines a device call wrote: ``cases bench`` with ``DDTREE_GPU_LAB_BUDGETS="15 31 auto"`` (the fixed budgets
``auto``'s widths are, for a drafter block of 16; ``bench_summary`` per server and concurrency,
``bench_widths``: what the adaptive server chose).

Per pair and concurrency: DFLASH's tokens/s, each server's ratio to it, the fastest fixed budget, and the
adaptive server against it (goal: at least the best fixed minus 2 % and at least DFLASH); the width the
adaptive server verifies at that concurrency (the batch-size bucket that holds it) against the fastest
fixed budget (goal: the same in at least 9 of 12 pair x concurrency cells).

    python scripts/bench/adaptive_width_figures.py docs/bench/FILE.jsonl [FILE ...]
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from round_price_figures import read  # the raw lines: one reader for the figures scripts

FIXED = re.compile(r"-ddtree-b(\d+)$")


def chosen_width(table: dict[str, str], concurrency: int) -> str | None:
    """The width a server whose table is ``{batch size: width}`` verifies for ``concurrency`` requests (the
    smallest size that holds it; the largest beyond it)."""
    if not table:
        return None
    sizes = sorted(int(s) for s in table)
    at = min(bisect.bisect_left(sizes, concurrency), len(sizes) - 1)
    return table[str(sizes[at])]


def cells(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (pair, adaptive server, concurrency)."""
    summary: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    for r in lines:
        if r.get("case") == "bench_summary" and r.get("output_tokens_per_s"):
            summary[(r["pair"], int(r["concurrency"]))][r["server"]] = float(r["output_tokens_per_s"])
    widths = {(r["pair"], r["server"]): r for r in lines if r.get("case") == "bench_widths"}
    out = []
    for (pair, level), rates in sorted(summary.items()):
        dflash = rates.get(f"{pair}-dflash")
        fixed = {m.group(1): v for name, v in rates.items() if (m := FIXED.search(name))}
        best = max(fixed, key=fixed.get) if fixed else None
        for (wpair, name), state in widths.items():
            if wpair != pair or name not in rates:
                continue
            auto = rates[name]
            out.append({
                "pair": pair, "server": name, "concurrency": level, "auto_tok_s": round(auto, 1),
                "dflash_tok_s": dflash and round(dflash, 1), "vs_dflash": dflash and round(auto / dflash, 3),
                "best_fixed": best, "vs_best_fixed": best and round(auto / fixed[best], 3),
                "fixed_vs_dflash": {b: dflash and round(v / dflash, 3) for b, v in sorted(fixed.items())},
                "chosen": chosen_width(state.get("table") or {}, level),
                "exploring": state.get("exploring"),
            })  # fmt: skip
    return out


def table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| pair | c | DFLASH tok/s | fixed x DFLASH | auto x DFLASH | auto x best fixed | best fixed | "
           "auto chose |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        fixed = ", ".join(f"{b}: {v}" for b, v in r["fixed_vs_dflash"].items())
        out.append(f"| {r['pair']} | {r['concurrency']} | {r['dflash_tok_s']} | {fixed} | {r['vs_dflash']} | "
                   f"{r['vs_best_fixed']} | {r['best_fixed']} | {r['chosen']} |")  # fmt: skip
    met = [r for r in rows if r["vs_best_fixed"] is not None and r["vs_dflash"] is not None]
    ok = sum(r["vs_best_fixed"] >= 0.98 and r["vs_dflash"] >= 1.0 for r in met)
    same = sum(r["chosen"] is not None and r["chosen"] == r["best_fixed"] for r in rows)
    out += ["", f"auto >= best fixed - 2 % and >= DFLASH: {ok} of {len(met)} cells; "
                f"chose the fastest fixed budget: {same} of {len(rows)} cells (goal 9 of 12)"]  # fmt: skip
    return out


def phases_table(lines: list[dict[str, Any]]) -> list[str]:
    """A load whose concurrency changes inside one run (``DDTREE_GPU_LAB_PHASES``): each server's tokens/s
    over the whole run and its ratio to DFLASH (goal: auto ahead of every fixed budget and of DFLASH)."""
    rows = [r for r in lines if r.get("case") == "bench_phases" and r.get("output_tokens_per_s")]
    out: list[str] = []
    for pair in sorted({r["pair"] for r in rows}):
        mine = {r["server"]: r for r in rows if r["pair"] == pair}
        dflash = mine.get(f"{pair}-dflash", {}).get("output_tokens_per_s")
        phases = " -> ".join(str(p) for p in next(iter(mine.values()))["phases"])
        out += ["", f"{pair}, concurrency {phases} in one run:"]
        out += ["| server | tok/s | x DFLASH |", "|---|---|---|"]
        for name, r in sorted(mine.items()):
            ratio = round(r["output_tokens_per_s"] / dflash, 3) if dflash else None
            out.append(f"| {name} | {r['output_tokens_per_s']} | {ratio} |")
        autos = [n for n in mine if not FIXED.search(n) and "-ddtree-b" in n]
        fixed = [n for n in mine if FIXED.search(n)]
        for name in autos:
            ahead = all(mine[name]["output_tokens_per_s"] > mine[f]["output_tokens_per_s"] for f in fixed)
            beats = dflash is not None and mine[name]["output_tokens_per_s"] > dflash
            out.append(f"{name}: ahead of every fixed budget: {ahead}; ahead of DFLASH: {beats}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--json", action="store_true", help="one JSON line per cell instead of the table")
    args = parser.parse_args(argv)
    lines = read(args.files)
    rows = cells(lines)
    if not rows:
        print("no adaptive server in these lines (cases bench with DDTREE_GPU_LAB_BUDGETS holding auto)")
        return 1
    for line in ([json.dumps(r) for r in rows] if args.json else table(rows) + phases_table(lines)):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
