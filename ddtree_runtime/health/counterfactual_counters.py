"""Counterfactual acceptance as a host reads it: the server's ``sglang:ddtree_counterfactual_*`` counters
(``core/counterfactual.py`` in the worker) parsed from its /metrics, and per budget the estimate with its
spread. Host side: stdlib + prometheus_client's text parser.

What the numbers mean and when to trust them: docs/counterfactual-acceptance.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from ddtree_runtime.health import http_client, sglang_client

PREFIX = "sglang:ddtree_counterfactual_"
ROUND_FIELDS = ("rounds_scored", "rounds_sampled", "rounds_dropped", "rounds_discarded",
                "real_emitted_tokens", "real_emitted_tokens_squared")  # fmt: skip
BUDGET_FIELDS = ("accepted_tokens", "accepted_tokens_squared", "round_weight", "accepted_tokens_x_real")
CHAIN = "chain"


class NoCounterfactual(ValueError):
    """The /metrics text carries no counterfactual counters (scoring off, or not this server kind)."""


def parse_metrics(text: str) -> dict[str, Any]:
    """``{"rounds_scored", "rounds_sampled", "rounds_dropped", "rounds_discarded", "real_emitted_tokens",
    "budgets": {label: {"accepted_tokens", "accepted_tokens_squared", "round_weight"}}}``, summed over
    the server's label sets (one server serves one model). Raises NoCounterfactual, or ValueError for
    text that is not Prometheus' format or holds negative / non-finite counts."""
    out: dict[str, Any] = {k: 0.0 for k in ROUND_FIELDS}
    budgets: dict[str, dict[str, float]] = {}
    seen = False
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises ValueError and others for text it cannot read
        raise ValueError(f"not Prometheus text format: {exc}") from None
    for fam in families:
        for s in fam.samples:
            if not s.name.startswith(PREFIX) or not s.name.endswith("_total"):
                continue
            field = s.name[len(PREFIX) : -len("_total")]
            if not math.isfinite(s.value) or s.value < 0:
                raise ValueError(f"{s.name} = {s.value}: a counter must be a finite count >= 0")
            if field in ROUND_FIELDS:
                out[field] += s.value
                seen = True
            elif field in BUDGET_FIELDS:
                label = s.labels.get("budget")
                if not label:
                    raise ValueError(f"{s.name} without a budget label")
                budgets.setdefault(label, {k: 0.0 for k in BUDGET_FIELDS})[field] += s.value
    if not seen or not budgets:
        raise NoCounterfactual(
            "no sglang:ddtree_counterfactual_* counters in these metrics: start the server with a drafter "
            "and --speculative-ddtree-counterfactual-fraction > 0 (and --enable-metrics)"
        )
    out["budgets"] = budgets
    return out


def fetch_metrics(url: str, *, timeout: float = 10.0) -> str:
    """The server's /metrics text (``url`` is its base URL). Raises http_client.HTTPFailure or
    ValueError (a bad URL, an HTTP error status)."""
    base = http_client.check_base_url(url)
    status, body = sglang_client.metrics(base, timeout=timeout)
    if status != 200:
        raise ValueError(f"GET {base}/metrics answered HTTP {status} (is --enable-metrics set?)")
    return body.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Estimate:
    """One candidate's figures over the scored rounds."""

    label: str  # "chain", "16", "16/cap4"
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
        head = self.label.split("/", 1)[0]
        return None if self.label == CHAIN else int(head) if head.isdigit() else None

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


def estimates(counts: dict[str, Any]) -> list[Estimate]:
    """Per candidate, from :func:`parse_metrics`'s counts (empty when no round is scored yet).

    The standard error treats rounds as independent and applies the spread of the per-round accepted
    count to the renewal-weighted figure (relative error of ``mean + 1``); consecutive rounds of one
    request are correlated, so read it as a floor on the uncertainty, not a ceiling.
    """
    n = int(counts["rounds_scored"])
    real = float(counts["real_emitted_tokens"])
    real_sq = float(counts.get("real_emitted_tokens_squared", 0.0))
    if n <= 0:
        return []
    out = []
    for label, c in sorted(counts["budgets"].items(), key=lambda kv: _order(kv[0])):
        acc, acc_sq = c["accepted_tokens"], c["accepted_tokens_squared"]
        mean = acc / n
        var = max(acc_sq / n - mean * mean, 0.0)
        sd = math.sqrt(var * n / (n - 1)) if n > 1 else 0.0
        tpr = real / c["round_weight"] if c["round_weight"] > 0 else mean + 1
        se = tpr * (sd / math.sqrt(n)) / (mean + 1)
        # d = (a + 1) - r per round: sum d = A + N - R, sum d^2 = Q + N + S + 2A - 2X - 2R.
        cross = c.get("accepted_tokens_x_real", 0.0)
        d_sum = acc + n - real
        d_sq = acc_sq + n + real_sq + 2 * acc - 2 * cross - 2 * real
        d_mean = d_sum / n
        d_var = max(d_sq / n - d_mean * d_mean, 0.0) * (n / (n - 1) if n > 1 else 0.0)
        running = d_sum == 0 and d_sq == 0 and real_sq > 0
        out.append(Estimate(label, n, mean, sd, tpr, se, d_mean, math.sqrt(d_var / n), running))
    return out


def _order(label: str) -> tuple[int, str]:
    head = label.split("/", 1)[0]
    return (-1, label) if label == CHAIN else (int(head) if head.isdigit() else 1 << 30, label)
