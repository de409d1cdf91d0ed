"""Counterfactual acceptance as a host reads it: the server's ``sglang:ddtree_counterfactual_*`` counters
(``core/counterfactual.py`` in the worker) parsed from its /metrics, checked against everything a real scorer
can emit (``core/counterfactual_invariants.py``), and per budget the estimate with its spread. Host side:
stdlib + prometheus_client's text parser.

What the numbers mean and when to trust them: docs/counterfactual-acceptance.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from ddtree_runtime.core.counterfactual_invariants import (
    CANDIDATE_COUNTERS,
    PREFIX,
    ROUND_COUNTERS,
    Counters,
    EvidenceError,
    check_counters,
)
from ddtree_runtime.core.decoder_settings import (
    CHAIN,
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
    DecoderSettings,
    SettingsError,
    parse_label,
)
from ddtree_runtime.health import http_client, sglang_client

ROUND_FIELDS = ROUND_COUNTERS
BUDGET_FIELDS = CANDIDATE_COUNTERS
MAX_METRICS_BYTES = 16 * 1024 * 1024  # a /metrics answer or a saved scrape above this is refused, not cut

__all__ = ["EvidenceError", "NoCounterfactual", "check_counters", "counters_from_state", "read_counters"]


class NoCounterfactual(ValueError):
    """The /metrics text carries no counterfactual counters (scoring off, or not this server kind)."""


def _sample_key(name: str, labels: Mapping[str, str]) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


def parse_metrics(text: str) -> dict[str, Any]:
    """``{"rounds_scored", "rounds_sampled", "rounds_dropped", "rounds_discarded", "real_emitted_tokens",
    "real_emitted_tokens_squared", "budgets": {label: {"accepted_tokens", "accepted_tokens_squared",
    "round_weight", "accepted_tokens_x_real"}}}`` as the text says them, not yet checked (see
    :func:`read_counters`). One server's one model: a series given twice (two scrapes concatenated) or
    label sets other than ``budget`` that differ (two models' counters in one text) are EvidenceError.
    Raises NoCounterfactual when there are none, ValueError for text that is not Prometheus' format."""
    if len(text) > MAX_METRICS_BYTES:
        raise ValueError(f"the metrics text holds {len(text)} characters, more than {MAX_METRICS_BYTES}: "
                         "refused, never cut")
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises ValueError and others for text it cannot read
        raise ValueError(f"not Prometheus text format: {ascii(str(exc))[:160]}") from None
    out: dict[str, Any] = {}
    budgets: dict[str, dict[str, float]] = {}
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    model: tuple[tuple[str, str], ...] | None = None
    for fam in families:
        for s in fam.samples:
            if not s.name.startswith(PREFIX) or not s.name.endswith("_total"):
                continue
            key = _sample_key(s.name, s.labels)
            if key in seen:
                raise EvidenceError(s.name, s.value, "given twice with the same labels: one scrape of one "
                                    "server holds each series once (two scrapes concatenated?)")  # fmt: skip
            seen.add(key)
            others = tuple(sorted((k, v) for k, v in s.labels.items() if k != "budget"))
            if model is None:
                model = others
            elif others != model:
                raise EvidenceError(s.name, s.value, f"labels {dict(others)} beside {dict(model)}: one "
                                    "server's one model is read at a time (two models' counters in one "
                                    "text?)")  # fmt: skip
            counter = s.name[len(PREFIX) : -len("_total")]
            if counter in ROUND_COUNTERS:
                if "budget" in s.labels:
                    raise EvidenceError(s.name, s.value, "a round counter carries no budget label")
                out[counter] = s.value
            elif counter in CANDIDATE_COUNTERS:
                label = s.labels.get("budget")
                if not label:
                    raise EvidenceError(s.name, s.value, "a per-budget counter without a budget label")
                budgets.setdefault(label, {})[counter] = s.value
    if not out and not budgets:
        raise NoCounterfactual(
            "no sglang:ddtree_counterfactual_* counters in these metrics: start the server with a drafter "
            "and --speculative-ddtree-counterfactual-fraction > 0 (and --enable-metrics)"
        )
    out["budgets"] = budgets
    return out


def read_counters(text: str, *, horizon: int | None = None, running: str | None = None) -> Counters:
    """The server's counters from its /metrics text, checked (``check_counters``: EvidenceError names the
    counter, its value and the bound it breaks)."""
    return check_counters(parse_metrics(text), horizon=horizon, running=running)


def counters_from_state(doc: Any) -> Counters:
    """A stored ``counterfactual/UNIT.json`` (what :func:`record_counterfactual` writes), its counts checked
    as the server's own (``core/counterfactual_invariants``): a state file is input like any other, and
    ``ddtree fleet status`` reads the same documents from each host. ValueError (EvidenceError) names the
    counter, its value and the bound."""
    if not isinstance(doc, dict):
        raise ValueError("the document is not an object")
    horizon, running = doc.get("horizon"), doc.get("running")
    if horizon is not None and (isinstance(horizon, bool) or not isinstance(horizon, int)):
        raise ValueError(f"horizon {str(horizon)[:40]!r} is not a whole number")
    if running is not None:
        running = parse_label(running, what="running setting")
    counts = doc.get("counts")
    if not isinstance(counts, dict):
        raise ValueError("no counts object")
    return check_counters(counts, horizon=horizon, running=running)


def fetch_metrics(url: str, *, timeout: float = 10.0) -> str:
    """The server's /metrics text (``url`` is its base URL). Raises http_client.HTTPFailure or
    ValueError (a bad URL, an HTTP error status, an answer above MAX_METRICS_BYTES or not UTF-8)."""
    base = http_client.check_base_url(url)
    status, body = sglang_client.metrics(base, timeout=timeout)
    if status != 200:
        raise ValueError(f"GET {base}/metrics answered HTTP {status} (is --enable-metrics set?)")
    if len(body) > MAX_METRICS_BYTES:
        raise ValueError(f"GET {base}/metrics answered {len(body)} bytes, more than {MAX_METRICS_BYTES}: "
                         "refused, never cut")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"GET {base}/metrics answered bytes that are not UTF-8 text") from None


@dataclass(frozen=True)
class ServerDecoder:
    """What a server's /server_info says it decodes with: the setting's label (None: not one a label names,
    ``why`` says), and its drafter's horizon (None: not said)."""

    label: str | None
    horizon: int | None
    why: str = ""
    # An adaptive server (no one label): its settings, each width a label of its own (``at_budget``).
    adaptive: DecoderSettings | None = None


def server_decoder(info: Any) -> ServerDecoder:
    """The running setting and the drafter's horizon from a ``/server_info`` answer, read by the one
    reader (``sglang_client.read_server_info``: algorithm, block size, the plugin's budget and top-K
    cap), by the decoder settings' own rule."""
    if not isinstance(info, Mapping):
        return ServerDecoder(None, None, "its /server_info is not an object")
    server = sglang_client.read_server_info(dict(info))
    block = server.block_size
    if block is not None and not MIN_BLOCK_SIZE <= block <= MAX_BLOCK_SIZE:
        block = None
    horizon = None if block is None else block - 1
    if server.algorithm == "DFLASH":
        return ServerDecoder(CHAIN, horizon)
    if server.algorithm != "DDTREE":
        return ServerDecoder(None, horizon, f"it runs {server.algorithm[:40]}, not DDTREE or DFLASH")
    if block is None:
        return ServerDecoder(None, None, "its /server_info has no speculative_dflash_block_size")
    budget, cap = server.budget, server.topk_cap
    try:
        settings = DecoderSettings(budget, block, cap, server.widths)
    except SettingsError as exc:
        return ServerDecoder(None, horizon, f"its /server_info settings cannot run: {exc}")
    if settings.adaptive:
        why = (f"it runs adaptive widths {settings.shown}: each round verifies the width its batch size pays "
               "for, so no one setting runs")  # fmt: skip
        return ServerDecoder(None, horizon, why, settings)
    if settings.label is None:
        why = f"it runs budget {budget} with top-K cap {cap}, which no label names"
        return ServerDecoder(None, horizon, why)
    return ServerDecoder(settings.label, horizon)


@dataclass(frozen=True)
class Estimate:
    """One candidate's figures over the scored rounds."""

    label: str  # "chain" or a decimal budget
    rounds: int
    mean_accepted: float  # drafted tokens accepted per scored round (the rounds this server started)
    sd_accepted: float  # their spread, round to round
    tokens_per_round: float  # renewal-weighted: what a server running it would emit per round
    tokens_per_round_se: float  # its standard error from the rounds sampled
    # Paired with the setting the server runs, round by round: d = (accepted + 1) - real tokens.
    paired_mean: float = 0.0
    paired_se: float = 0.0  # standard error of mean d: the difference's own noise, smaller than either's
    running: bool = False  # d is 0 on every round: this is the setting the server runs

    @property
    def budget(self) -> int | None:
        """The node budget, None for the chain (its budget is the drafter's horizon)."""
        return None if self.label == CHAIN else int(self.label)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "budget": self.budget,
            "rounds": self.rounds,
            "mean_accepted": self.mean_accepted,
            "sd_accepted": self.sd_accepted,
            "tokens_per_round": self.tokens_per_round,
            "tokens_per_round_se": self.tokens_per_round_se,
            "paired_mean": self.paired_mean,
            "paired_se": self.paired_se,
            "running": self.running,
        }


def estimates(counters: Counters) -> list[Estimate]:
    """Per candidate, from checked counters (empty when no round is scored yet).

    The standard error treats rounds as independent and applies the spread of the per-round accepted
    count to the renewal-weighted figure (relative error of ``mean + 1``); consecutive rounds of one
    request are correlated, so read it as a floor on the uncertainty, not a ceiling.
    """
    n = counters.rounds_scored
    if n <= 0:
        return []
    real = counters.real_emitted_tokens
    out = []
    for label, c in counters.candidates.items():
        acc, acc_sq = c.accepted_tokens, c.accepted_tokens_squared
        mean = acc / n
        var = max(acc_sq / n - mean * mean, 0.0)
        sd = math.sqrt(var * n / (n - 1)) if n > 1 else 0.0
        tpr = real / c.round_weight if c.round_weight > 0 else mean + 1
        se = tpr * (sd / math.sqrt(n)) / (mean + 1)
        d_sum, d_sq = counters.paired(label)  # d = (a + 1) - r per round
        d_mean = d_sum / n
        d_var = max(d_sq / n - d_mean * d_mean, 0.0) * (n / (n - 1) if n > 1 else 0.0)
        running = d_sum == 0 and d_sq == 0
        out.append(Estimate(label, n, mean, sd, tpr, se, d_mean, math.sqrt(d_var / n), running))
    return out
