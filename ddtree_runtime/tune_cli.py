"""`ddtree tune`: should this host run trees, and which budget? Reads the server's counterfactual
counters (what each budget would have accepted on its own traffic, ``health/counterfactual_counters.py``),
prices each setting's round on the host's GPU (``planner/tune.py``) and names the setting with the
most tokens/s at the host's concurrency, with the expected gain and its uncertainty. Writes nothing;
``--propose`` prints the host_vars change a normal deploy (or a canary) then applies.

Exit codes: 0 a recommendation (a change or not), 1 not enough evidence (too few rounds, no counters),
2 bad input, 3 the server did not answer.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from ddtree_runtime.health import counterfactual_counters as cf
from ddtree_runtime.health import http_client
from ddtree_runtime.planner import tune

MAX_FILE_BYTES = 16 * 1024 * 1024


def _read_text(path: str) -> str:
    if path == "-":
        return sys.stdin.read(MAX_FILE_BYTES + 1)[:MAX_FILE_BYTES]
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: not a regular file")
    if p.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
    return p.read_text(encoding="utf-8", errors="replace")


def _round_table(path: str) -> dict[str, dict[int, float]]:
    """``{"chain": {"1": 22.7, "4": 38.1}, "16": {...}}``: measured ms per round per concurrency."""
    try:
        doc = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--round-ms-json {path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(doc, dict) or not doc:
        raise ValueError(f"--round-ms-json {path}: want an object of setting -> {{concurrency: ms}}")
    table: dict[str, dict[int, float]] = {}
    for label, row in doc.items():
        if not isinstance(row, dict) or not row:
            raise ValueError(f"--round-ms-json: {label!r} must map concurrency to ms per round")
        clean: dict[int, float] = {}
        for c, ms in row.items():
            ok = (
                str(c).isdigit()
                and 1 <= int(c) <= 4096
                and isinstance(ms, int | float)
                and not isinstance(ms, bool)
            )
            if not ok or not math.isfinite(ms) or ms <= 0:
                raise ValueError(
                    f"--round-ms-json: {label!r}: {c!r}: {ms!r} is not concurrency 1..4096 -> ms > 0"
                )
            clean[int(c)] = float(ms)
        table[str(label)] = clean
    return table


def _current_from_server(url: str, timeout: float) -> str | None:
    """The setting the server runs, from its /server_info (None when it does not say)."""
    status, body = http_client.request(http_client.check_base_url(url) + "/server_info", timeout=timeout)
    if status != 200:
        return None
    try:
        info = json.loads(body)
    except ValueError:
        return None
    if not isinstance(info, dict):
        return None
    algo = str(info.get("speculative_algorithm") or "").upper()
    if algo == "DFLASH" or (algo == "DDTREE" and info.get("speculative_ddtree_topk_cap") == 1):
        return tune.CHAIN
    budget = info.get("speculative_ddtree_budget")
    if algo == "DDTREE" and isinstance(budget, int) and budget > 0:
        return str(budget)
    return None


def _running(text: str) -> float | None:
    """sglang:num_running_reqs from the same scrape (a snapshot, not an average)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = None
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "sglang:num_running_reqs" and math.isfinite(s.value):
                total = (total or 0.0) + s.value
    return total


def _report(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    text = fetch = None
    if args.url:
        fetch = args.url
        text = cf.fetch_metrics(args.url, timeout=args.timeout)
    else:
        text = _read_text(args.metrics_file)
    counts = cf.parse_metrics(text)
    est = cf.estimates(counts)
    current = args.current
    if current is None and fetch:
        current = _current_from_server(fetch, args.timeout)
    concurrency = args.concurrency
    concurrency_source = "--concurrency"
    if concurrency is None:
        running = _running(text)
        concurrency = max(1.0, running or 1.0)
        concurrency_source = "sglang:num_running_reqs (a snapshot: pass --concurrency for the host's usual)"
    table = _round_table(args.round_ms_json) if args.round_ms_json else None
    settings = [
        tune.Setting(e.label, e.tokens_per_round, e.tokens_per_round_se, e.paired_se, e.running) for e in est
    ]
    rounds = int(counts["rounds_scored"])
    rec = tune.recommend(settings, concurrency=concurrency, current=current, rounds=rounds, gpu=args.gpu,
                         tp=args.tp, table=table, min_rounds=args.min_rounds)  # fmt: skip
    rec["concurrency_source"] = concurrency_source
    if table:
        rec["cost_model"] = "measured table (--round-ms-json)"
    elif args.gpu == "H200" and args.tp == 1:
        rec["cost_model"] = "H200 production-shape figures"
    else:
        rec["cost_model"] = f"modelled from the H200 figures by memory bandwidth ({args.gpu} x tp {args.tp})"
    rec["estimates"] = [e.to_dict() for e in est]
    rec["counts"] = {k: counts[k] for k in cf.ROUND_FIELDS}
    if args.propose:
        rec["host_vars"] = _host_vars(rec, args.horizon)
    return 0, rec


def _host_vars(rec: dict[str, Any], horizon: int) -> dict[str, Any] | None:
    if not rec["change"] or rec["recommended"] is None:
        return None
    return {"sglang_service_flag_overrides": tune.flag_overrides(rec["recommended"], horizon=horizon)}


def _print(rec: dict[str, Any]) -> None:
    print(f"GPU {rec['gpu']} x tp {rec['tp']}, concurrency {rec['concurrency']:g} "
          f"({rec['concurrency_source']})")  # fmt: skip
    print(f"cost: {rec['cost_model']}; {rec['rounds']} rounds scored")
    print(f"{'setting':>8} {'tok/round':>14} {'ms/round':>9} {'tok/s':>16}")
    for r in rec["table"]:
        mark = " <- runs now" if r["setting"] == rec["current"] else ""
        tpr = f"{r['tokens_per_round']:>7.3f} ± {r['tokens_per_round_se']:<5.3f}"
        tps = f"{r['tokens_per_s']:>8.1f} ± {r['tokens_per_s_se']:<6.1f}"
        print(f"{r['setting']:>8} {tpr}{r['round_ms']:>9.1f} {tps}{mark}")
    if rec["gain"] is None:
        print(f"best: {rec['recommended']} (the current setting is unknown or unpriced: pass --current)")
    elif rec["change"]:
        gain = f"{rec['gain'] * 100:+.1f} % tokens/s ± {rec['gain_se'] * 100:.1f} %"
        how = rec["gain_se_method"]
        print(f"recommend: {rec['recommended']} instead of {rec['current']}: {gain} (1 s.e., {how})")
    elif rec["gain_se_method"] == "none":
        print(f"keep: {rec['current']} (the best setting here)")
    else:
        best = max(rec["table"], key=lambda r: r["tokens_per_s"])["setting"]
        gain = f"{rec['gain'] * 100:+.1f} % ± {rec['gain_se'] * 100:.1f} %"
        print(f"keep: {rec['current']} (best is {best}, {gain} ({rec['gain_se_method']}): "
              "not two standard errors clear of zero)")  # fmt: skip
    if "host_vars" in rec:
        if rec["host_vars"] is None:
            print("host_vars: no change")
        else:
            print("host_vars change (then `ansible-playbook deploy.yml -l HOST`, or a canary):")
            print("sglang_service_flag_overrides:")
            for k, v in rec["host_vars"]["sglang_service_flag_overrides"].items():
                print(f"  {k}: {'null' if v is None else v}")


def _run(args: argparse.Namespace) -> int:
    try:
        code, rec = _report(args)
    except (tune.TooFewRounds, cf.NoCounterfactual) as exc:
        print(f"ddtree tune: {exc}", file=sys.stderr)
        return 1
    except http_client.HTTPFailure as exc:
        print(f"ddtree tune: {exc}", file=sys.stderr)
        return 3
    except (OSError, ValueError) as exc:
        print(f"ddtree tune: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rec, indent=2, sort_keys=True))
    else:
        _print(rec)
    return code


def _positive_int(value: str) -> int:
    if not value.isdigit() or not 1 <= int(value) <= 1_000_000:
        raise argparse.ArgumentTypeError(f"{value!r}: want an integer in 1..1000000")
    return int(value)


def _concurrency(value: str) -> float:
    try:
        c = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: want a number of running requests") from None
    if not math.isfinite(c) or not 1 <= c <= 4096:
        raise argparse.ArgumentTypeError(f"{value!r}: want a number of running requests in 1..4096")
    return c


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("tune", help="pick chain or a tree budget from the host's own traffic",
                              description=__doc__.splitlines()[0])  # fmt: skip
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="the server's base URL (reads /metrics and /server_info)")
    src.add_argument("--metrics-file", help="a saved /metrics scrape (- for stdin)")
    p.add_argument("--current", help="the setting the host runs: chain or a budget (default: /server_info)")
    p.add_argument("--concurrency", type=_concurrency, help="running requests the host usually has")
    p.add_argument(
        "--gpu", default="H200", choices=sorted(tune.BANDWIDTH_TBS), help="GPU kind (default H200)"
    )
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--round-ms-json", help="measured ms per round: {setting: {concurrency: ms}}")
    p.add_argument(
        "--min-rounds",
        type=_positive_int,
        default=tune.MIN_ROUNDS,
        help=f"scored rounds needed before recommending (default {tune.MIN_ROUNDS})",
    )
    p.add_argument("--horizon", type=_positive_int, default=15, help="drafter block - 1 (the chain's budget)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per HTTP request")
    p.add_argument("--propose", action="store_true", help="print the host_vars change (writes nothing)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run)
