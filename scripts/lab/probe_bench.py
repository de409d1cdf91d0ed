"""The live probe's wall time against one server, for one or more source trees of ddtree_runtime, alternating
(e.g. before and after a change to the probe: `git archive main ddtree_runtime | tar -x -C /tmp/main`).

    python scripts/lab/probe_bench.py --url http://10.213.0.131:30000 --src before=/tmp/main --src after=.

One JSON line per probe run (probe_seconds, generate_seconds, the lossless check's seconds), then one per
source tree with the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def run_probe(url: str, src: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src.resolve()), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-m", "ddtree_runtime", "probe", "live", "--url", url, "--json",
                           "--timeout", "120", "--min-accept-length", "1.5"],
                          capture_output=True, text=True, cwd="/", env=env, timeout=900)
    doc = json.loads(proc.stdout)
    figures, checked = doc["figures"], doc["figures"].get("lossless") or {}
    return {"ok": doc["ok"], "probe_seconds": figures.get("probe_seconds"),
            "generate_seconds": figures.get("generate_seconds"), "lossless_status": checked.get("status"),
            "lossless_seconds": checked.get("seconds"), "lossless_tokens": checked.get("tokens_checked")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--src", action="append", required=True, metavar="NAME=DIR",
                    help="a directory holding a ddtree_runtime package (repeatable)")
    ap.add_argument("-n", "--rounds", type=int, default=6)
    args = ap.parse_args()
    sources = [(name, Path(path)) for name, _, path in (s.partition("=") for s in args.src)]
    runs: dict[str, list[dict]] = {name: [] for name, _ in sources}
    for i in range(args.rounds):
        for name, src in sources if i % 2 == 0 else sources[::-1]:  # alternate who goes first
            result = run_probe(args.url, src)
            runs[name].append(result)
            print(json.dumps({"bench": "probe_wall", "src": name, "round": i, **result}), flush=True)
    for name, results in runs.items():
        def median(key: str, rows: list[dict] = results) -> float | None:
            values = [r[key] for r in rows if r[key] is not None]
            return round(statistics.median(values), 3) if values else None

        print(json.dumps({"bench": "probe_wall_median", "src": name, "rounds": len(results), "url": args.url,
                          **{k: median(k) for k in ("probe_seconds", "generate_seconds", "lossless_seconds")},
                          "probe_minus_generate_s": round(statistics.median(
                              r["probe_seconds"] - r["generate_seconds"] for r in results), 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
