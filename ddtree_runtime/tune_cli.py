"""`ddtree tune`: should this host run trees, and which budget? Reads the server's counterfactual
counters (what each budget would have accepted on its own traffic, ``health/counterfactual_counters.py``),
checks them against everything a real scorer can emit (``core/counterfactual_invariants.py``), prices each
setting's round on the host's GPU (``planner/tune.py``) and names, among the settings the host can run
(validated, and fitting its GPUs as ``ddtree plan`` decides: ``planner/tune_fit.py``), the one with the most
tokens/s at the host's concurrency, with the expected gain over the setting that runs and its uncertainty.
Writes nothing; ``--propose`` prints the host_vars change a normal deploy (or a canary) then applies.
A server running adaptive widths (``--speculative-ddtree-budget auto`` or a list) runs no one setting: the
table is printed, with the server's own figures per width, and nothing is compared or proposed.

Exit codes: 0 a recommendation (a change, or keep what runs), 1 not enough evidence (too few rounds, no
counters, no known current setting among the measured and priced ones), 2 bad input (counters no scorer
can emit, a label that is not ``chain`` or a decimal budget, input beyond its limits: one line naming what
and why), 3 the server did not answer.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from ddtree_runtime.core.decoder_settings import MAX_BLOCK_SIZE, DecoderSettings, parse_label
from ddtree_runtime.core.round_prices import PriceTable
from ddtree_runtime.health import counterfactual_counters as cf
from ddtree_runtime.health import http_client, sglang_client
from ddtree_runtime.health.width_state import width_metrics
from ddtree_runtime.planner import tune
from ddtree_runtime.planner.cli import load_profiles, read_input
from ddtree_runtime.planner.tune_fit import load_host_fit, profile_settings

DEFAULT_HORIZON = 15  # Qwen3.6-27B-DFlash's block 16, when neither --horizon nor the server says


def _round_table(path: str) -> dict[str, dict[int, float]]:
    """``{"chain": {"1": 22.7, "4": 38.1}, "16": {...}}``: measured ms per round per concurrency."""
    try:
        doc = json.loads(read_input(path))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--round-ms-json {path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(doc, dict) or not doc:
        raise ValueError(f"--round-ms-json {path}: want an object of setting -> {{concurrency: ms}}")
    table: dict[str, dict[int, float]] = {}
    for label, row in doc.items():
        label = parse_label(label, what="--round-ms-json setting")
        if not isinstance(row, dict) or not row:
            raise ValueError(f"--round-ms-json: {label!r} must map concurrency to ms per round")
        clean: dict[int, float] = {}
        for c, ms in row.items():
            ok = (
                str(c).isascii()
                and str(c).isdigit()
                and 1 <= int(c) <= 4096
                and isinstance(ms, int | float)
                and not isinstance(ms, bool)
            )
            if not ok or not math.isfinite(ms) or ms <= 0:
                raise ValueError(
                    f"--round-ms-json: {label!r}: {c!r}: {ms!r} is not concurrency 1..4096 -> ms > 0"
                )
            clean[int(c)] = float(ms)
        table[label] = clean
    return table


def _running(text: str) -> float | None:
    """sglang:num_running_reqs from the same scrape (a snapshot, not an average)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = None
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "sglang:num_running_reqs" and math.isfinite(s.value):
                total = (total or 0.0) + s.value
    return total


def _horizon(args: argparse.Namespace, server: cf.ServerDecoder | None) -> tuple[int, str]:
    said = server.horizon if server is not None else None
    if args.horizon is not None and said is not None and args.horizon != said:
        raise ValueError(f"--horizon {args.horizon}, but the server's drafter block is {said + 1} (horizon "
                         f"{said}): drop --horizon or read the right server")  # fmt: skip
    if said is not None:
        return said, "the server's speculative_dflash_block_size - 1"
    if args.horizon is not None:
        return args.horizon, "--horizon"
    return DEFAULT_HORIZON, f"the default {DEFAULT_HORIZON} (Qwen3.6-27B-DFlash; pass --horizon)"


Adaptive = DecoderSettings | None  # adaptive widths' settings where no one label names what runs


def _current(args: argparse.Namespace, server: cf.ServerDecoder | None, horizon: int,
             profile_runs: DecoderSettings | None) -> tuple[str | None, str, Adaptive]:  # fmt: skip
    """The setting that runs, who said so (None: nobody did, or no one label names it), and, when it is
    adaptive widths, their settings (each round picks one: no one setting to compare against)."""
    if args.current is not None:
        return parse_label(args.current, what="--current"), "--current", None
    if server is not None:
        if server.label is not None:
            return server.label, "the server's /server_info", None
        if server.adaptive is not None:
            return None, "the server's /server_info", server.adaptive
        return None, f"the server's /server_info does not say ({server.why})", None
    if args.profile is not None:
        runs = profile_runs
        if runs is None:
            profile = load_profiles(args.profiles).get(args.profile)
            if profile is None:
                raise ValueError(f"unknown profile {args.profile!r} (profiles.yml)")
            runs = profile_settings(profile.get("flags") or {}, horizon + 1)
        return runs.label, f"profile {args.profile}", runs if runs.adaptive else None
    return None, "nobody says", None


def _report(args: argparse.Namespace) -> dict[str, Any]:
    server = None
    prices = None  # the server's own start-up price table (--speculative-ddtree-price-table)
    info: Any = None
    if args.url:
        base = http_client.check_base_url(args.url)
        text = cf.fetch_metrics(base, timeout=args.timeout)
        _status, info = sglang_client.server_info(base, timeout=args.timeout)
        server = cf.server_decoder(info)
        prices = sglang_client.server_prices(info)  # BadAnswer (exit 2) when malformed
    else:
        text = read_input(args.metrics_file)
    counts = cf.parse_metrics(text)
    table = _round_table(args.round_ms_json) if args.round_ms_json else None  # bad input before evidence
    horizon, horizon_source = _horizon(args, server)
    fit, profile_runs = None, None
    if args.models_json and not args.profile:
        raise ValueError("--models-json needs --profile NAME: each setting's fit is planned at the profile's "
                         "flags (its running requests, context, state dtype)")  # fmt: skip
    if args.models_json:
        fit, profile_runs = load_host_fit(args.models_json, profile=args.profile, profiles_file=args.profiles,
                                          gpus=args.gpus, gpu=args.gpu, tp=args.tp)  # fmt: skip
    current, current_source, adaptive = _current(args, server, horizon, profile_runs)
    widths = _width_figures(info, text) if adaptive is not None else None
    counters = cf.check_counters(counts, horizon=horizon, running=current)
    if current is None and adaptive is None and counters.rounds_scored >= args.min_rounds:
        raise tune.NoComparison(f"the setting this host runs is unknown ({current_source}): pass --current "
                                "chain|BUDGET or --profile NAME; no proposal without it")  # fmt: skip
    est = cf.estimates(counters)
    concurrency = args.concurrency
    concurrency_source = "--concurrency"
    if concurrency is None:
        running = _running(text)
        concurrency = max(1.0, min(running or 1.0, 4096.0))
        concurrency_source = "sglang:num_running_reqs (a snapshot: pass --concurrency for the host's usual)"
    settings = [
        tune.Setting(e.label, e.tokens_per_round, e.tokens_per_round_se, e.paired_se, e.running) for e in est
    ]
    labels = [s.label for s in settings]
    left_out = None
    if (current is not None and current in labels) or adaptive is not None:
        left_out = tune.runnable(labels, current=current, horizon=horizon, fit=fit, runs=adaptive)
    server_ms = prices.round_ms() if prices is not None and table is None else None
    rec = tune.recommend(settings, concurrency=concurrency, current=current, rounds=counters.rounds_scored,
                         gpu=args.gpu, tp=args.tp, table=table, min_rounds=args.min_rounds,
                         left_out=left_out, server=server_ms, adaptive=adaptive)  # fmt: skip
    rec["current_source"] = current_source
    rec["adaptive"] = None if adaptive is None else {
        "setting": adaptive.shown, "widths": [str(b) for b in adaptive.widths], "state": widths}
    rec["horizon"], rec["horizon_source"] = horizon, horizon_source
    rec["fit"] = ("ddtree plan (--models-json)" if fit
                  else "not planned: no setting that needs more memory than what runs")  # fmt: skip
    rec["concurrency_source"] = concurrency_source
    rec["cost_model"] = _cost_model(args, table, prices)
    rec["server_prices"] = prices.to_dict() if prices is not None else None
    rec["estimates"] = [e.to_dict() for e in est]
    rec["counts"] = {k: getattr(counters, k) for k in cf.ROUND_FIELDS}
    if args.propose:
        rec["host_vars"] = _host_vars(rec, horizon)
    return rec


def _width_figures(info: Any, text: str) -> dict[str, Any] | None:
    """An adaptive server's own account of its widths: /server_info's ``ddtree_widths`` (the table per batch
    size, rounds and tokens per round per width; BadAnswer, exit 2, when malformed), else the /metrics
    series ``sglang:ddtree_width_*`` (rounds and tokens per round per width); None when it gives neither."""
    state = sglang_client.server_width_state(info) if info is not None else None
    if state is not None:
        source = "/server_info ddtree_widths"
        return {**state.to_dict(), "source": source, "per_batch_size": state.table_text()}
    series = width_metrics(text)
    if not series:
        return None
    return {"source": "/metrics sglang:ddtree_width_*",
            "rounds": {w: int(v["rounds"]) for w, v in series.items() if "rounds" in v},
            "tokens_per_round": {w: v["tokens_per_round"] for w, v in series.items()
                                 if "tokens_per_round" in v}}  # fmt: skip


def _cost_model(args: argparse.Namespace, table: Any, prices: PriceTable | None) -> str:
    """Which round costs priced the table, in words (each row's ``cost_source`` says it per setting)."""
    if table:
        ignored = "; the server's own price table is not used" if prices is not None else ""
        return f"measured table (--round-ms-json){ignored}"
    if args.gpu == "H200" and args.tp == 1:
        figures = "H200 production-shape figures"
    else:
        figures = f"modelled from the H200 figures by memory bandwidth ({args.gpu} x tp {args.tp})"
    if prices is None:
        return figures
    sizes = {w: prices.batch_sizes(w) for w in prices.widths()}
    shown = "; ".join(f"{w} at batch sizes {','.join(map(str, b))}" for w, b in sizes.items())
    return (f"the server's own price table ({prices.method}, {shown}) for the settings it priced; the others "
            f"from the {figures} scaled to the server's price of the running setting (adaptive widths: of "
            "the narrowest width measured and priced)")  # fmt: skip


def _host_vars(rec: dict[str, Any], horizon: int) -> dict[str, Any] | None:
    if not rec["change"]:
        return None
    return {"sglang_service_flag_overrides": tune.flag_overrides(rec["recommended"], horizon=horizon)}


def _print(rec: dict[str, Any]) -> None:
    adaptive = rec.get("adaptive")
    runs = f"adaptive widths {adaptive['setting']}" if adaptive else rec["current"]
    print(f"GPU {rec['gpu']} x tp {rec['tp']}, concurrency {rec['concurrency']:g} "
          f"({rec['concurrency_source']})")  # fmt: skip
    print(f"cost: {rec['cost_model']}; fit: {rec['fit']}; {rec['rounds']} rounds scored; "
          f"runs now: {runs} ({rec['current_source']})")  # fmt: skip
    if adaptive:
        _print_widths(adaptive)
    print(f"{'setting':>8} {'tok/round':>14} {'ms/round':>9} {'tok/s':>16}")
    for r in rec["table"]:
        mark = " <- runs now" if r["setting"] == rec["current"] else ""
        if adaptive and r["setting"] in adaptive["widths"]:
            mark = " <- one of its widths"
        if r["cost_source"] != tune.COST_FIGURES:
            mark += f" [cost: {r['cost_source']}]"
        if r["left_out"]:
            mark += f" (left out: {r['left_out']})"
        tpr = f"{r['tokens_per_round']:>7.3f} ± {r['tokens_per_round_se']:<5.3f}"
        tps = f"{r['tokens_per_s']:>8.1f} ± {r['tokens_per_s_se']:<6.1f}"
        print(f"{r['setting']:>8} {tpr}{r['round_ms']:>9.1f} {tps}{mark}")
    if adaptive:
        best = rec["best_runnable"] or "none"
        print(f"adaptive: each round verifies the width its batch size pays for, so no one setting runs and "
              f"nothing is compared; the best single setting here is {best}. To weigh it against the widths, "
              "pin it on one host (host_vars) or canary it beside this one")  # fmt: skip
        if "host_vars" in rec:
            print("host_vars: no change proposed (no one setting runs to compare against)")
        return
    gain = f"{rec['gain'] * 100:+.1f} % tokens/s ± {rec['gain_se'] * 100:.1f} %"
    if rec["change"]:
        print(f"recommend: {rec['recommended']} instead of {rec['current']}: {gain} (1 s.e., "
              f"{rec['gain_se_method']})")  # fmt: skip
    elif rec["gain_se_method"] == "none":
        print(f"keep: {rec['current']} (the best setting the host can run here)")
    else:
        print(f"keep: {rec['current']} (best runnable is {rec['best_runnable']}, {gain} "
              f"({rec['gain_se_method']}): not two standard errors clear of zero)")  # fmt: skip
    if "host_vars" in rec:
        if rec["host_vars"] is None:
            print("host_vars: no change")
        else:
            print("host_vars change (then `ansible-playbook deploy.yml -l HOST`, or a canary):")
            print("sglang_service_flag_overrides:")
            for k, v in rec["host_vars"]["sglang_service_flag_overrides"].items():
                print(f"  {k}: {'null' if v is None else v}")


def _print_widths(adaptive: dict[str, Any]) -> None:
    """The server's own figures per width (its state, or its /metrics series), one line."""
    state = adaptive.get("state")
    if not state:
        print("its widths: no figures published (/server_info ddtree_widths, /metrics sglang:ddtree_width_*)")
        return
    parts = []
    if state.get("per_batch_size"):
        parts.append(f"width per batch size {state['per_batch_size']}")
    rounds, tokens = state.get("rounds") or {}, state.get("tokens_per_round") or {}
    for w in adaptive["widths"]:
        own = f"{tokens[w]:.3f} tok/round" if w in tokens else "not yet observed"
        parts.append(f"{w}: {rounds.get(w, 0)} rounds, {own}")
    print(f"its widths ({state['source']}): " + "; ".join(parts))


def one_line(text: object, limit: int = 500) -> str:
    """A message as one printable line: whitespace runs folded, anything unprintable escaped."""
    flat = " ".join(str(text).split())
    shown = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in flat)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def _run(args: argparse.Namespace) -> int:
    try:
        rec = _report(args)
    except (tune.TooFewRounds, cf.NoCounterfactual) as exc:
        print(f"ddtree tune: {one_line(exc)}", file=sys.stderr)
        return 1
    except http_client.HTTPFailure as exc:
        print(f"ddtree tune: {one_line(exc)}", file=sys.stderr)
        return 3
    except cf.EvidenceError as exc:
        print(f"ddtree tune: counters refused: {one_line(exc)}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"ddtree tune: {one_line(exc)}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rec, indent=2, sort_keys=True))
    else:
        _print(rec)
    return 0


def _positive_int(value: str) -> int:
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= 1_000_000:
        raise argparse.ArgumentTypeError(f"{value!r}: want an integer in 1..1000000")
    return int(value)


def _horizon_arg(value: str) -> int:
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) < MAX_BLOCK_SIZE:
        raise argparse.ArgumentTypeError(f"{value!r}: want the drafter's horizon (block - 1), "
                                         f"1..{MAX_BLOCK_SIZE - 1}")
    return int(value)


def _seconds(value: str) -> float:
    try:
        s = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: want seconds") from None
    if not math.isfinite(s) or not 0 < s <= 86400:
        raise argparse.ArgumentTypeError(f"{value!r}: want seconds in (0, 86400]")
    return s


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
    p.add_argument("--horizon", type=_horizon_arg, default=None, help="drafter block - 1, the chain's budget "
                   f"(default: the server's, else {DEFAULT_HORIZON})")  # fmt: skip
    p.add_argument("--models-json", help="the host's models (`model_files.py describe`, as `ddtree plan "
                   "--models-json`): each setting's fit is planned")  # fmt: skip
    p.add_argument("--profile", help="the host's profile (profiles.yml): its flags for the fit, and the "
                   "setting it runs when neither --current nor the server says")  # fmt: skip
    p.add_argument("--profiles", help="profiles.yml to read (default: the checkout's)")
    p.add_argument("--gpus", help="the host's GPUs for the fit, as `ddtree plan --gpus` (default: the "
                   "profile's runs_on, else --tp x --gpu)")  # fmt: skip
    p.add_argument("--timeout", type=_seconds, default=10.0, help="seconds per HTTP request (0-86400)")
    p.add_argument("--propose", action="store_true", help="print the host_vars change (writes nothing)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run)
