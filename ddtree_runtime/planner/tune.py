"""`ddtree tune`'s arithmetic: a host's measured tokens per round per setting (chain or a tree budget,
from the counterfactual counters) against a round-cost model per setting for its GPU, at its
concurrency; the setting with the most tokens/s, the expected gain over the current one and its
uncertainty. Stdlib only; the verb (``ddtree_runtime/tune_cli.py``) feeds it.

Round costs (ms per decode round of the whole batch), Qwen3.6-27B's shape:

* H200, measured (docs/bench/prod-shape.md, "Overlapped trees"; raw lines
  ``docs/bench/2026-12-02-h200-prod-shape-overlapped.jsonl``: the real SGLang 0.5.23 server, CUDA
  graphs, fp32 SSM state, dummy weights so acceptance 1.016 for both, trees under SGLang's overlap
  scheduler): chain (DFLASH's decode; DDTREE's top-k cap 1 runs the same) and budget 16, from the
  ``bench`` lines of **repeat 1** only. Repeat 0 is cold: DDTREE's first batch of each new size compiles
  Triton kernels inside the round (SGLang's ``move_kv_cache``, which the page-1 KV commit calls, and the
  plugin's top-K and walk kernels: 0.3-0.7 s each), and DFLASH's repeat 0 at 4 is cold too, so a mean
  over both repeats prices warm-up, not a round. At concurrency 1 the decode round of one request,
  (wall / 8 - median TTFT) / 63 rounds: 22.85 / 23.97 ms; at 4 and 16 from tokens/s,
  running requests x 1.016 / tok/s: chain 129.83 and 308.65 tok/s, budget 16 118.34 and 261.8 tok/s.
  Both servers held 16 running requests (``prod_start``'s pool line: max_running_requests=16), so the
  points at 16 are at 16.
* H200, modelled from those: budget 8 priced as 16 (not measured; its host gap and tree mask are the
  same, the 8 GDN rows it saves are under 1 ms and not credited); budgets 32 and 64 as 16 plus the GDN
  verify's extra time for their rows (docs/bench/gdn-tree-price.md, fp32 state: +8.5 ms at one request,
  +37.4 ms at eight for 64; 32 one third of that), the attention and MLP cost of the extra rows not
  counted (so larger trees look no worse than they are; they are rarely cheaper).
* Other GPUs (``--gpu A6000``), modelled: the GPU part of each H200 round scaled by the memory-bandwidth
  ratio (H200 4.8 TB/s over the GPU's, times the tensor-parallel size: decode at this shape reads the
  weights every round), the host part kept as is; no all-reduce or PCIe cost. The host part is none for
  the chain and ``TREE_HOST_GAP_MS`` for a tree: the budget-16 round at concurrency 1 less the chain's
  (1.1 ms), since there a tree's kernels cost no more than the chain's (25.0 against 25.7 ms a round
  under SGLang's profiler) and the difference is host time the GPU waits for. Not measured: a measured
  table (``--round-ms-json``) replaces it.

Between measured concurrencies the cost is interpolated linearly, beyond the last it is extrapolated
with the last segment's slope.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ddtree_runtime.core.decoder_settings import (
    CHAIN,
    VALIDATED_MAX_BUDGET,
    DecoderSettings,
    parse_label,
    settings_for_label,
)

MIN_ROUNDS = (
    200  # below this the spread of the estimates is too wide to act on (docs/counterfactual-acceptance.md)
)

# ms per round at concurrency c, H200, Qwen3.6-27B shape, trees overlapped (see module doc): the
# repeat-1 bench lines of 2026-12-02-h200-prod-shape-overlapped.jsonl, 16 running requests each.
H200_MEASURED: dict[str, dict[int, float]] = {
    CHAIN: {
        1: (12.9276 / 8 - 0.17622) / 63 * 1e3,
        4: 4 * 1.016 / 129.83 * 1e3,
        16: 16 * 1.016 / 308.65 * 1e3,
    },
    "16": {1: (13.6365 / 8 - 0.19469) / 63 * 1e3, 4: 4 * 1.016 / 118.34 * 1e3, 16: 16 * 1.016 / 261.8 * 1e3},
}
# A tree round's host time the GPU waits for, beyond the chain's: at concurrency 1 the two rounds' kernels
# cost the same (module doc), so it is the difference of the two measured rounds.
TREE_HOST_GAP_MS = H200_MEASURED["16"][1] - H200_MEASURED[CHAIN][1]
# GDN verify time a 64-node tree adds over a 16-node one (fp32 state), at 1 and 8 requests.
GDN_EXTRA_64_MS = {1: 10.66 - 2.15, 8: 47.01 - 9.66}
BANDWIDTH_TBS = {"H200": 4.8, "H100": 3.35, "A100": 2.0, "A6000": 0.768, "L40S": 0.864}


@dataclass(frozen=True)
class Setting:
    """A candidate as measured on the host: its label, tokens per round and that figure's std error."""

    label: str
    tokens_per_round: float
    tokens_per_round_se: float
    # The standard error of this setting's tokens per round minus the running setting's, measured on
    # the same rounds (None: not paired), and whether this is the setting the server runs.
    paired_se: float | None = None
    running: bool = False


def _interp(table: Mapping[int, float], c: float) -> float:
    xs = sorted(table)
    if len(xs) == 1:
        return table[xs[0]] * c / xs[0]
    if c <= xs[0]:
        lo, hi = xs[0], xs[1]
    elif c >= xs[-1]:
        lo, hi = xs[-2], xs[-1]
    else:
        hi = next(x for x in xs if x >= c)
        lo = xs[xs.index(hi) - 1]
    slope = (table[hi] - table[lo]) / (hi - lo)
    return max(table[lo] + slope * (c - lo), 1e-6)


def _gdn_extra_ms(budget: int, c: float) -> float:
    """GDN verify time a tree of ``budget`` nodes adds over budget 16 (linear in rows, in requests)."""
    if budget <= 16:
        return 0.0
    one, eight = GDN_EXTRA_64_MS[1], GDN_EXTRA_64_MS[8]
    extra64 = one + (eight - one) * (c - 1) / 7 if c <= 8 else eight * c / 8
    return extra64 * (budget - 16) / 48


def h200_round_ms(label: str, c: float) -> float:
    """Modelled H200 round for a setting label (``chain`` or a budget) at concurrency ``c``."""
    if label == CHAIN:
        return _interp(H200_MEASURED[CHAIN], c)
    budget = _budget(label)
    return _interp(H200_MEASURED["16"], c) + _gdn_extra_ms(budget, c)


def round_ms(label: str, c: float, *, gpu: str = "H200", tp: int = 1,
             table: Mapping[str, Mapping[int, float]] | None = None) -> float:  # fmt: skip
    """ms per round for a setting on a GPU kind at concurrency ``c`` (see the module doc)."""
    if table is not None:
        if label not in table:
            raise KeyError(label)
        return _interp(table[label], c)
    h200 = h200_round_ms(label, c)
    if gpu == "H200" and tp == 1:
        return h200
    if gpu not in BANDWIDTH_TBS:
        raise ValueError(
            f"no cost model for GPU {gpu!r}: use one of {', '.join(BANDWIDTH_TBS)} or --round-ms-json"
        )
    host = 0.0 if label == CHAIN else TREE_HOST_GAP_MS
    scale = BANDWIDTH_TBS["H200"] / (BANDWIDTH_TBS[gpu] * tp)
    return (h200 - host) * scale + host


# Where a row's round cost came from (``recommend``'s ``cost_source``).
COST_TABLE = "table"  # the operator's measured table (--round-ms-json)
COST_SERVER = "server"  # the server's own start-up price table, at this setting
COST_SERVER_SCALED = "server-scaled"  # the figures, scaled by the server's price of the running setting
COST_FIGURES = "figures"  # the figures written above (H200 measured, other GPUs by bandwidth)


def priced_ms(label: str, c: float, *, gpu: str = "H200", tp: int = 1,
              table: Mapping[str, Mapping[int, float]] | None = None,
              server: Mapping[str, Mapping[int, float]] | None = None,
              anchor: str | None = None) -> tuple[float, str]:  # fmt: skip
    """ms per round and its source (``COST_*``). An operator's ``table`` is used alone (KeyError for a
    setting it lacks). A server's own table (``core/round_prices.PriceTable.round_ms``, per batch size)
    prices the settings it measured; the others get the figures' cost scaled by the server's price of
    ``anchor`` (the setting that runs) over the figures' for it: the host's level, the figures' ratios.
    Without either, the figures."""
    if table is not None:
        return round_ms(label, c, table=table), COST_TABLE
    if server:
        if label in server:
            return _interp(server[label], c), COST_SERVER
        if anchor is not None and anchor in server:
            scale = _interp(server[anchor], c) / round_ms(anchor, c, gpu=gpu, tp=tp)
            return round_ms(label, c, gpu=gpu, tp=tp) * scale, COST_SERVER_SCALED
    return round_ms(label, c, gpu=gpu, tp=tp), COST_FIGURES


def _budget(label: str) -> int:
    return int(parse_label(label, what="setting"))


class TooFewRounds(ValueError):
    """Not enough evidence to recommend anything (the verb's exit 1): too few rounds scored."""


class NoComparison(TooFewRounds):
    """No known current setting among the measured and priced ones: nothing to compare against (exit 1)."""


Fit = Callable[[DecoderSettings], str | None]  # why a setting does not fit the host (None: it fits)


def runnable(labels: list[str], *, current: str | None, horizon: int, fit: Fit | None = None,
             runs: DecoderSettings | None = None) -> dict[str, Any]:  # fmt: skip
    """Per setting, why the host cannot run it (None: it can): above the validated limit
    (``decoder_settings.VALIDATED_MAX_BUDGET``), or not fitting the host's GPUs as ``ddtree plan``
    decides (``fit``: the reason, None when it fits). Without a plan, a setting that needs more memory
    per request than the one that runs (a wider KV window or verify) is left out: its fit is unknown.
    ``runs``: what the server runs when no one label names it (adaptive widths: the widest sizes memory)."""
    block = horizon + 1
    if current is None and runs is None:
        raise ValueError("runnable needs the setting that runs: its label, or its settings (runs=)")
    now = settings_for_label(current, block) if current is not None else runs
    assert now is not None
    shown = current if current is not None else now.shown
    out: dict[str, str | None] = {}
    for label in labels:
        s = settings_for_label(label, block)
        if label == current:
            out[label] = None  # it runs: keeping it is always possible
        elif not s.validated:
            out[label] = (f"budget {s.budget} is above {VALIDATED_MAX_BUDGET}, the largest shown lossless on "
                          "the H200 with CUDA graphs (docs/bench/gpu-lab-server.md)")  # fmt: skip
        elif fit is not None:
            out[label] = fit(s)
        elif s.kv_window > now.kv_window or s.verify_rows > now.verify_rows:
            out[label] = (f"needs more memory per request than {shown} (KV window {s.kv_window} > "
                          f"{now.kv_window} or verify rows {s.verify_rows} > {now.verify_rows}) and its fit "
                          "is not planned: give --models-json (ddtree plan's) to decide")  # fmt: skip
        else:
            out[label] = None
    return out


def recommend(settings: list[Setting], *, concurrency: float, current: str | None, rounds: int,
              gpu: str = "H200", tp: int = 1, table: Mapping[str, Mapping[int, float]] | None = None,
              min_rounds: int = MIN_ROUNDS, left_out: Mapping[str, str | None] | None = None,
              server: Mapping[str, Mapping[int, float]] | None = None,
              adaptive: DecoderSettings | None = None) -> dict[str, Any]:  # fmt: skip
    """The table and the pick among the settings the host can run (``left_out``: label -> why not, from
    :func:`runnable`; ``server``: the server's own prices, :func:`priced_ms`). Raises TooFewRounds /
    NoComparison (not enough evidence: exit 1) and ValueError.

    ``adaptive``: the server runs these widths (``current`` None: no one setting runs, each round picks
    its width). The table is priced as for any server (its prices scaled by the narrowest of its widths
    that the server priced), the best runnable setting named, and nothing compared or recommended: there
    is no single current setting to compare against (``recommended`` and ``gain`` None)."""
    if not (isinstance(concurrency, int | float) and math.isfinite(concurrency) and 1 <= concurrency <= 4096):
        raise ValueError(f"concurrency must be a number in 1..4096, got {concurrency!r}")
    if rounds < min_rounds:
        raise TooFewRounds(
            f"only {rounds} rounds scored; {min_rounds} are needed before the estimates are worth acting on "
            "(raise --speculative-ddtree-counterfactual-fraction or wait for more greedy traffic)"
        )
    measured = [s.label for s in settings]
    anchor = current
    if current is None and adaptive is not None:
        widths = [str(b) for b in adaptive.widths]
        anchor = next((w for w in widths if w in measured and server and w in server), None)
    elif current is None:
        raise NoComparison("the setting this host runs is unknown: pass --current chain|BUDGET or --profile "
                           "NAME, or --url of a server whose /server_info says it; no proposal without it")
    if current is not None and current not in measured:
        raise NoComparison(f"the host runs {current}, which the counters do not measure (they hold "
                           f"{', '.join(measured) or 'none'}): add it to the server's "
                           "--speculative-ddtree-counterfactual-budgets; no proposal without it")  # fmt: skip
    left_out = left_out or {}
    rows = []
    for s in settings:
        try:
            ms, source = priced_ms(s.label, concurrency, gpu=gpu, tp=tp, table=table, server=server,
                                   anchor=anchor)  # fmt: skip
        except KeyError:
            if s.label == current:
                raise NoComparison(f"the round-cost table (--round-ms-json) has no cost for {current}, the "
                                   "setting that runs: nothing to compare against") from None  # fmt: skip
            continue  # a measured table without this setting: not priced, not ranked
        tps = concurrency * s.tokens_per_round / ms * 1e3
        rel = s.tokens_per_round_se / s.tokens_per_round if s.tokens_per_round > 0 else 0.0
        rows.append({"setting": s.label, "tokens_per_round": s.tokens_per_round,
                     "tokens_per_round_se": s.tokens_per_round_se, "round_ms": ms,
                     "tokens_per_s": tps, "tokens_per_s_se": tps * rel, "paired_se": s.paired_se,
                     "running": s.running, "left_out": left_out.get(s.label),
                     "cost_source": source})  # fmt: skip
    candidates = [r for r in rows if r["left_out"] is None]
    if current is None:  # adaptive: the table and the best runnable setting, nothing to compare against
        best_label = max(candidates, key=lambda r: r["tokens_per_s"])["setting"] if candidates else None
        return {"gpu": gpu, "tp": tp, "concurrency": concurrency, "rounds": rounds, "current": None,
                "recommended": None, "best_runnable": best_label, "table": rows, "gain": None,
                "gain_se": None, "gain_se_method": "none", "change": False}  # fmt: skip
    cur = next(r for r in rows if r["setting"] == current)
    best = max(candidates, key=lambda r: r["tokens_per_s"])
    gain = best["tokens_per_s"] / cur["tokens_per_s"] - 1
    if best is cur:
        se, how = 0.0, "none"
    elif cur["running"] and best["paired_se"] is not None:
        # Both measured on the same rounds: the ratio's noise is the difference's, relative to the
        # best's tokens per round (first order), much less than the two errors combined.
        se, how = (1 + gain) * best["paired_se"] / best["tokens_per_round"], "paired"
    else:
        rel_b = best["tokens_per_s_se"] / best["tokens_per_s"]
        rel_c = cur["tokens_per_s_se"] / cur["tokens_per_s"]
        se, how = (1 + gain) * math.hypot(rel_b, rel_c), "independent"
    # Act only on a gain two standard errors clear of zero; otherwise keep what runs.
    change = best is not cur and gain - 2 * se > 0
    return {"gpu": gpu, "tp": tp, "concurrency": concurrency, "rounds": rounds, "current": current,
            "recommended": best["setting"] if change else current, "best_runnable": best["setting"],
            "table": rows, "gain": gain, "gain_se": se, "gain_se_method": how, "change": change}  # fmt: skip


def flag_overrides(setting: str, *, horizon: int = 15) -> dict[str, int | None]:
    """The profile flags a setting needs (profiles.yml spelling): the chain is DDTREE's top-k cap 1 at
    budget = the drafter's horizon (DFlash's own decode under the plugin); a tree is its budget, no cap."""
    return settings_for_label(setting, horizon + 1).flags()
