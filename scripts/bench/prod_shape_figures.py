"""The figures of ``docs/bench/prod-shape.md``'s "Overlapped trees" section, from the raw lines.

    .venv/bin/python scripts/bench/prod_shape_figures.py \
        docs/bench/2026-12-02-h200-prod-shape-overlapped.jsonl \
        --before docs/bench/2026-12-02-h200-prod-shape.jsonl [--traces .device-run/traces]

Prints Markdown: tokens/s per concurrency and repeat with the DDTREE/DFLASH ratios, ms per round at
concurrency 1 (end-to-end less time to first token, over the decode rounds of one request), the points
``ddtree tune`` takes, the profiler's per-round figures and its kernel time by stage and family. With
``--traces`` (SGLang's /start_profile traces, git-ignored: 7-16 MB each) also the per-round GPU time
excluding the first round, the Triton compiles inside the profiled window and, for the c=1 tree
round, where the GPU idles. Stdlib only (the trace part borrows the GPU lab's ``profile_gaps``).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SERVERS = {"DFLASH": "prod-dflash-fp32", "DDTREE 16": "prod-ddtree16-fp32"}
STAGES = ("VERIFY", "DRAFT", "between")


def rows(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def bench(lines: list[dict[str, Any]], call: int | None = None) -> dict[tuple[str, int, int], dict[str, Any]]:
    return {
        (r["server"], r["concurrency"], r["repeat"]): r
        for r in lines
        if r.get("bench") == "server" and (call is None or r.get("call") == call)
    }


def decode_round_ms(b: dict[str, Any]) -> float:
    """One request's decode round at concurrency 1: (wall / requests - TTFT) / rounds per request."""
    per_request = b["wall_s"] / b["requests"] - b["ttft_ms_median"] / 1e3
    return per_request / (b["verify_steps"] / b["requests"]) * 1e3


def wave_round_ms(b: dict[str, Any], c: int) -> float:
    """The same at concurrency ``c``, as if the requests ran in lockstep waves of ``c`` (a cross-check:
    the benchmark's requests start together and all ask for 64 tokens)."""
    waves = b["requests"] / c
    per_wave = b["wall_s"] / waves - b["ttft_ms_median"] / 1e3
    return per_wave / (b["verify_steps"] / b["requests"]) * 1e3


def running(lines: list[dict[str, Any]], server: str) -> int:
    pool = next(r for r in lines if r.get("case") == "prod_start" and r["server"] == server)["pool"][0]
    return int(pool.split("max_running_requests=")[1].split(",")[0])


def bench_tables(now: list[dict[str, Any]], before: list[dict[str, Any]]) -> None:
    b, old = bench(now), bench(before, call=2)
    d, t = SERVERS["DFLASH"], SERVERS["DDTREE 16"]
    print("| concurrency | repeat | DFLASH tok/s | DDTREE 16 tok/s | DDTREE / DFLASH | before overlap |")
    print("|---|---|---|---|---|---|")
    for c in (1, 4, 16):
        for rep in (0, 1):
            x, y = b[(d, c, rep)]["output_tokens_per_s"], b[(t, c, rep)]["output_tokens_per_s"]
            ox, oy = old[(d, c, rep)]["output_tokens_per_s"], old[(t, c, rep)]["output_tokens_per_s"]
            print(f"| {c} | {rep}{' (warm)' if rep else ''} | {x:.1f} | {y:.1f} | **{y / x:.2f}** "
                  f"| {oy / ox:.2f} ({oy:.1f} / {ox:.1f}) |")  # fmt: skip
        mx, my = (statistics.mean(b[(s, c, r)]["output_tokens_per_s"] for r in (0, 1)) for s in (d, t))
        ox, oy = (statistics.mean(old[(s, c, r)]["output_tokens_per_s"] for r in (0, 1)) for s in (d, t))
        print(f"| {c} | mean | {mx:.1f} | {my:.1f} | {my / mx:.2f} | {oy / ox:.2f} |")
    print()
    print("| repeat | TTFT median ms, DFLASH / DDTREE, c=1 | c=4 | c=16 | TTFT p90 ms c=4 | c=16 |")
    print("|---|---|---|---|---|---|")
    for rep in (0, 1):
        cells = [
            f"{b[(d, c, rep)]['ttft_ms_median']:.0f} / {b[(t, c, rep)]['ttft_ms_median']:.0f}"
            for c in (1, 4, 16)
        ]
        cells += [
            f"{b[(d, c, rep)]['ttft_ms_p90']:.0f} / {b[(t, c, rep)]['ttft_ms_p90']:.0f}" for c in (4, 16)
        ]
        print(f"| {rep} | " + " | ".join(cells) + " |")
    print()
    print("| ms per decode round, c=1 | DFLASH | DDTREE 16 | ratio |")
    print("|---|---|---|---|")
    for rep in (0, 1):
        x, y = decode_round_ms(b[(d, 1, rep)]), decode_round_ms(b[(t, 1, rep)])
        print(f"| overlapped, repeat {rep} | {x:.2f} | {y:.2f} | {y / x:.3f} |")
    x, y = decode_round_ms(old[(d, 1, 1)]), decode_round_ms(old[(t, 1, 1)])
    print(f"| before overlap, repeat 1 | {x:.2f} | {y:.2f} | {y / x:.3f} |")
    for c in (4, 16):
        x, y = wave_round_ms(b[(d, c, 1)], c), wave_round_ms(b[(t, c, 1)], c)
        print(f"| c={c} as waves of {c}, repeat 1 (cross-check) | {x:.2f} | {y:.2f} | {y / x:.3f} |")
    print()
    print("`ddtree tune`'s H200 points (ms per round of the whole batch; repeat 1; at 4 and 16")
    print("running x 1.016 / tok/s, with the running requests each server held):")
    print()
    for label, s in SERVERS.items():
        n = running(now, s)
        pts = {1: decode_round_ms(b[(s, 1, 1)])}
        pts.update({c: min(c, n) * 1.016 / b[(s, c, 1)]["output_tokens_per_s"] * 1e3 for c in (4, 16)})
        print(
            f"- {label} (max_running_requests={n}): " + ", ".join(f"c={c}: {v:.2f}" for c, v in pts.items())
        )
    print()


def profile_tables(now: list[dict[str, Any]], before: list[dict[str, Any]]) -> None:
    prof = {(r["server"], r["concurrency"]): r for r in now if r.get("case") == "prod_profile"}
    old = {
        (r["server"], r["concurrency"]): r
        for r in before
        if r.get("case") == "prod_profile" and r.get("call") == 3
    }
    d, t = SERVERS["DFLASH"], SERVERS["DDTREE 16"]
    cols = [(old.get((d, 1)), "DFLASH c=1 before"), (old.get((t, 1)), "DDTREE c=1 before"),
            (prof[(d, 1)], "DFLASH c=1"), (prof[(t, 1)], "DDTREE c=1"),
            (prof[(d, 8)], "DFLASH c=8"), (prof[(t, 8)], "DDTREE c=8")]  # fmt: skip
    print("| per round | " + " | ".join(name for _, name in cols) + " |")
    print("|---|" + "---|" * len(cols))

    def line(label: str, get) -> None:
        print(f"| {label} | " + " | ".join(get(p) for p, _ in cols) + " |")

    line("rounds", lambda p: str(p["rounds"]))
    line("round ms (GPU, first verify to last)", lambda p: f"{p['round_ms']:.2f}")
    line("GPU idle ms", lambda p: f"**{p['gpu_idle_per_round_ms']:.2f}**")
    line("verify GPU window ms", lambda p: f"{p['gpu_ms_per_round']['VERIFY']:.2f}")
    line("drafter GPU window ms", lambda p: f"{p['gpu_ms_per_round']['DRAFT']:.2f}")
    line("host syncs", lambda p: f"{p['host_syncs_per_round']:g}")
    line("device-to-host copies", lambda p: f"{p['dtoh_copies_per_round']:g}")
    line("host ms in them", lambda p: f"{p['host_wait_per_round_ms']:.2f}")
    print()
    for c in (1, 8):
        kd, kt = prof[(d, c)]["kernels_per_round"], prof[(t, c)]["kernels_per_round"]
        weight: Counter[str] = Counter()
        for k in (kd, kt):
            for s in STAGES:
                weight.update(k.get(s, {}).get("families_ms", {}))
        # Families under 0.05 ms a round in every cell are left out (the totals keep them).
        fams = [
            f
            for f, _ in weight.most_common()
            if max(k.get(s, {}).get("families_ms", {}).get(f, 0) for k in (kd, kt) for s in STAGES) >= 0.05
        ]
        print(f"Kernel ms per round at concurrency {c} (DFLASH / DDTREE 16; `kernels_per_round`):")
        print()
        print("| stage | total | " + " | ".join(fams) + " |")
        print("|---|---|" + "---|" * len(fams))
        tot = [0.0, 0.0]
        for s in STAGES:
            a, z = kd.get(s, {}), kt.get(s, {})
            tot[0] += a.get("kernel_ms", 0)
            tot[1] += z.get("kernel_ms", 0)
            cells = [
                f"{a.get('families_ms', {}).get(f, 0):.2f} / {z.get('families_ms', {}).get(f, 0):.2f}"
                for f in fams
            ]
            print(
                f"| {s} | **{a.get('kernel_ms', 0):.2f} / {z.get('kernel_ms', 0):.2f}** | "
                + " | ".join(cells)
                + " |"
            )
        print(f"| all | **{tot[0]:.2f} / {tot[1]:.2f}** ({tot[1] / tot[0] - 1:+.1%}) |" + " |" * len(fams))
        print()
        print(f"Top VERIFY kernels at concurrency {c} (ms / launches per round):")
        print()
        print("| DFLASH | DDTREE 16 |")
        print("|---|---|")
        for a, z in zip(kd["VERIFY"]["top_kernels"][:6], kt["VERIFY"]["top_kernels"][:6], strict=True):
            left = f"`{a['name'][:48]}` {a['ms']:.2f} / {a['calls']:g}"
            print(f"| {left} | `{z['name'][:48]}` {z['ms']:.2f} / {z['calls']:g} |")
        print()


def trace_figures(traces: Path) -> None:
    sys.path.insert(0, str(REPO / "scripts/lab/sglang-gpu-lab"))
    from ddtree_sglang_gpu_lab import profile_gaps as pg

    for label, server in SERVERS.items():
        for c in (1, 8):
            path = traces / f"{server}-c{c}.trace.json.gz"
            if not path.exists():
                continue
            ev = pg.load_trace(path)
            vg = pg.merged_starts(
                (e["ts"], e["ts"] + e.get("dur", 0))
                for e in ev
                if e.get("cat") == "gpu_user_annotation" and e.get("name", "").startswith("step[VERIFY")
            )
            gpu = sorted(
                (e["ts"], e["ts"] + e.get("dur", 0)) for e in ev if e.get("cat") in pg.GPU_CATEGORIES
            )
            rounds, idle = [], []
            for lo, hi in itertools.pairwise(vg):
                busy = pg.union_length(pg._clip(gpu, lo, hi))
                rounds.append((hi - lo) / 1e3)
                idle.append((hi - lo - busy) / 1e3)
            rest = rounds[1:]
            print(f"- {label} c={c}: first round {rounds[0]:.1f} ms; the other {len(rest)}: median "
                  f"{statistics.median(rest):.2f}, min {min(rest):.2f}, max {max(rest):.2f} ms, GPU idle "
                  f"median {statistics.median(idle[1:]):.2f} ms")  # fmt: skip
            py = [e for e in ev if e.get("cat") == "python_function"]
            frames = pg._frames_by_thread(ev)
            for comp in (e for e in py if "_do_compile" in e["name"]):
                where = "inside" if vg[0] <= comp["ts"] <= vg[-1] else "before"
                site = pg.issuing_frame(comp, frames)
                ms = comp["dur"] / 1e3
                print(f"  - Triton compile {ms:.0f} ms, {where} the profiled rounds, under `{site}`")
    # Where the c=1 tree round's GPU idles: the innermost plugin/SGLang frame on the scheduler thread,
    # sampled every 20 us of each idle gap (rounds after the first).
    path = traces / f"{SERVERS['DDTREE 16']}-c1.trace.json.gz"
    if path.exists():
        ev = pg.load_trace(path)
        vg = pg.merged_starts(
            (e["ts"], e["ts"] + e.get("dur", 0))
            for e in ev
            if e.get("cat") == "gpu_user_annotation" and e.get("name", "").startswith("step[VERIFY")
        )
        gpu = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in ev if e.get("cat") in pg.GPU_CATEGORIES)
        py = [e for e in ev if e.get("cat") == "python_function"]
        tid = Counter((e["pid"], e["tid"]) for e in py).most_common(1)[0][0]
        own = sorted((e for e in py if (e["pid"], e["tid"]) == tid and pg.OWN_FRAME.search(e["name"])),
                     key=lambda e: e["ts"])  # fmt: skip
        starts = [e["ts"] for e in own]
        sampled: Counter[str] = Counter()
        end = None
        gaps = []
        for a, b in gpu:
            if b <= vg[1] or a >= vg[-1]:
                continue
            a = max(a, vg[1])
            if end is not None and a - end > 50:
                gaps.append((end, a))
            end = b if end is None else max(end, b)
        for a, b in gaps:
            t = a
            while t < b:
                i = bisect.bisect_right(starts, t)
                stack = [f for f in own[max(0, i - 3000) : i] if f["ts"] + f.get("dur", 0) > t]
                sampled[pg.OWN_FRAME.search(stack[-1]["name"]).group(0) if stack else "none"] += 1
                t += 20
        n = len(vg) - 2
        print(f"\nDDTREE c=1, GPU idle by the host frame running (ms per round, {n} rounds):")
        for site, k in sampled.most_common(6):
            print(f"  - {k * 0.02 / n:.2f} `{site}`")
        host_children(pg, path, "run_tree_round")
    path = traces / f"{SERVERS['DFLASH']}-c1.trace.json.gz"
    if path.exists():
        host_children(pg, path, "dflash_worker_v2.py(2336)")


def host_children(pg: Any, path: Path, parent: str, top: int = 9) -> None:
    """Host ms per round (under the profiler) of each plugin/SGLang frame called straight from
    ``parent`` on the scheduler thread, over the rounds after the first."""
    ev = pg.load_trace(path)
    vc = sorted(
        e["ts"]
        for e in ev
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith("step[VERIFY")
    )
    lo, hi, n = vc[1], vc[-1], len(vc) - 2
    py = [e for e in ev if e.get("cat") == "python_function" and lo <= e["ts"] < hi]
    tid = Counter((e["pid"], e["tid"]) for e in py).most_common(1)[0][0]
    own = sorted(
        (e for e in py if (e["pid"], e["tid"]) == tid and pg.OWN_FRAME.search(e["name"])),
        key=lambda e: (e["ts"], -e.get("dur", 0)),
    )
    stack: list[dict[str, Any]] = []
    spent: Counter[str] = Counter()
    total = 0.0
    for e in own:
        while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) <= e["ts"]:
            stack.pop()
        if stack and parent in stack[-1]["name"]:
            spent[pg.OWN_FRAME.search(e["name"]).group(0) + " " + e["name"].rsplit(": ", 1)[-1]] += e["dur"]
        if parent in e["name"]:
            total += e["dur"]
        stack.append(e)
    print(f"\n{path.name.split('.')[0]}: host round (VERIFY to VERIFY) {(hi - lo) / 1e3 / n:.2f} ms;")
    print(f"`{parent}` {total / 1e3 / n:.2f} ms a round on the host, of which:")
    for site, us in spent.most_common(top):
        print(f"  - {us / 1e3 / n:.2f} `{site}`")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("jsonl", type=Path)
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--traces", type=Path)
    args = ap.parse_args()
    now, before = rows(args.jsonl), rows(args.before)
    bench_tables(now, before)
    profile_tables(now, before)
    if args.traces:
        trace_figures(args.traces)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
