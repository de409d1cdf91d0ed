"""Print issue 40's tables (the tree round's price against DFLASH's) from the raw JSON lines a device
call wrote (``docs/bench/*.jsonl``): the round stages eager against replayed from graphs
(``round_stages_bench.py``), and each server's tokens/s and its ratio to DFLASH at every concurrency
(``cases bench`` / ``cases prod`` summaries), with the time of a round at one request.

    python scripts/bench/round_price_figures.py docs/bench/FILE.jsonl [FILE ...]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any


def read(paths: list[Path]) -> list[dict[str, Any]]:
    lines = []
    for path in paths:
        for raw in path.read_text().splitlines():
            raw = raw.strip()
            if raw.startswith("{"):
                try:
                    lines.append(json.loads(raw))
                except json.JSONDecodeError:
                    continue
    return lines


def stages_table(lines: list[dict[str, Any]]) -> list[str]:
    rows = [r for r in lines if r.get("bench") == "round_stages"]
    if not rows:
        return []
    by_key: dict[tuple[int, int], dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        by_key[(r["batch"], r["budget"])][r["mode"]] = r
    out = [
        "| batch | budget | host us eager | host us graphs | host ratio | wall us eager | wall us graphs |",
        "|---|---|---|---|---|---|---|",
    ]
    for (batch, budget), modes in sorted(by_key.items()):
        e, g = modes.get("eager", {}), modes.get("graph", {})
        out.append(
            f"| {batch} | {budget} | {e.get('host_us')} | {g.get('host_us')} | {g.get('host_vs_eager')} "
            f"| {e.get('wall_us')} | {g.get('wall_us')} |"
        )
    return out


def round_ms(row: dict[str, Any]) -> float | None:
    """A round's time at one request: tokens per round over one request's tokens per second."""
    per_request, accept = row.get("per_request_tokens_per_s_median"), row.get("accept_length")
    if not per_request or accept is None:
        return None
    return round(1000.0 * float(accept) / float(per_request), 2)


def servers_table(lines: list[dict[str, Any]]) -> list[str]:
    rows = [r for r in lines if r.get("case") in ("bench_summary", "prod_summary")]
    if not rows:
        return []
    levels = sorted({r["concurrency"] for r in rows})
    dflash = {(r.get("pair", "prod"), r["concurrency"]): r for r in rows if "dflash" in r["server"]}
    head = "| server | tokens/round | " + " | ".join(f"c={c} tok/s (x DFLASH)" for c in levels)
    out = [head + " | c=1 ms/round | identical to plain |", "|---" * (len(levels) + 4) + "|"]
    by_server: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        by_server[r["server"]][r["concurrency"]] = r
    for server, per_level in sorted(by_server.items()):
        cells = []
        for c in levels:
            r = per_level.get(c)
            if r is None:
                cells.append("-")
                continue
            base = dflash.get((r.get("pair", "prod"), c))
            ratio = r.get("vs_dflash")
            if ratio is None and base and base.get("output_tokens_per_s"):
                ratio = round(r["output_tokens_per_s"] / base["output_tokens_per_s"], 3)
            cells.append(f"{r['output_tokens_per_s']:.1f} ({ratio})")
        first = per_level.get(min(levels), {})
        same = [
            str(r.get("identical_to_plain"))
            for r in per_level.values()
            if r.get("identical_to_plain") is not None
        ]
        out.append(
            f"| {server} | {first.get('accept_length')} | "
            + " | ".join(cells)
            + f" | {round_ms(first)} | {'/'.join(same) or '-'} |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+", type=Path)
    lines = read(parser.parse_args().files)
    for title, table in (("Round stages, eager vs graphs", stages_table(lines)),
                         ("Servers", servers_table(lines))):  # fmt: skip
        if table:
            print(f"## {title}\n")
            print("\n".join(table))
            print()


if __name__ == "__main__":
    main()
