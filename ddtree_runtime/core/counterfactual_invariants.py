"""What counterfactual counters a real scorer can emit, written once: every reader checks them here before
it estimates anything (the metrics reader ``health/counterfactual_counters``, ``ddtree tune``, ``ddtree
fleet status``, the exporter, and a server-side chooser to come).

The scorer (``core/counterfactual.py``) counts, over the N rounds it scored, per round: the tokens the real
round emitted ``r`` (1 <= r <= L + 1, L the drafter's horizon) and, per candidate, the drafted tokens it
would have accepted ``a`` (0 <= a <= m, m = min(budget, L); the chain's m = L). Its counters are sums over
those rounds: ``real_emitted_tokens`` = sum r, ``..._squared`` = sum r^2, per candidate ``accepted_tokens``
= sum a, ``accepted_tokens_squared`` = sum a^2, ``accepted_tokens_x_real`` = sum a r, ``round_weight`` = sum
r / (a + 1). So, whatever the traffic:

* every count is a finite whole number >= 0 below 2^53 (round_weight: a finite number);
* rounds: scored + dropped + discarded <= sampled (each sampled round is one of them, or still pending);
* per round bounds, summed: N <= sum r <= N (L + 1); sum a <= N m; sum a <= sum a^2 <= m sum a;
  sum r <= sum r^2 <= (L + 1) sum r; sum a <= sum a r <= (L + 1) sum a; sum r / (m + 1) <= round_weight <=
  sum r;
* Cauchy-Schwarz (no negative variance, no forged cross term): N sum a^2 >= (sum a)^2, N sum r^2 >=
  (sum r)^2, (N sum a r - sum a sum r)^2 <= (N sum a^2 - (sum a)^2) (N sum r^2 - (sum r)^2) (a covariance
  within what the two spreads allow), round_weight (sum a r + sum r) >= (sum r)^2, and for the paired
  difference d = a + 1 - r: sum d^2 >= 0 and N sum d^2 >= (sum d)^2;
* nesting: best-first trees of one cap are nested (a budget-16 tree is the first 16 nodes of the budget-32
  one), so on the same rounds a larger budget accepts at least as much: sum a, sum a^2, sum a r do not
  shrink and round_weight does not grow with the budget;
* the running setting: the candidate the server decodes with accepts exactly what the real round did
  (r = a + 1), so its sum d and sum d^2 are 0;
* labels are canonical (``chain`` or a decimal budget, ``core/decoder_settings.parse_label``), and one
  scrape holds one server's one model (the text reader checks that: ``health/counterfactual_counters``).

A break is :class:`EvidenceError`: one line naming the counter, its value and the bound. Standard library
only (the readers run without torch).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ddtree_runtime.core.decoder_settings import CHAIN, MAX_BLOCK_SIZE, SettingsError, parse_label

PREFIX = "sglang:ddtree_counterfactual_"
ROUND_COUNTERS = ("rounds_scored", "rounds_sampled", "rounds_dropped", "rounds_discarded",
                  "real_emitted_tokens", "real_emitted_tokens_squared")  # fmt: skip
CANDIDATE_COUNTERS = ("accepted_tokens", "accepted_tokens_squared", "round_weight", "accepted_tokens_x_real")
MAX_COUNT = 2**53  # a float holds every whole number below it: above, a count cannot be read exactly
MAX_CANDIDATES = 64
UNKNOWN_HORIZON = MAX_BLOCK_SIZE - 1  # the loosest bound, when no one says the drafter's block
_REL = 1e-9  # round_weight is a float sum: its checks allow this relative rounding


class EvidenceError(ValueError):
    """Counters no scorer can emit. ``counter`` (its /metrics name), ``value``, ``bound``: the message is
    one printable line with all three."""

    def __init__(self, counter: str, value: Any, bound: str) -> None:
        self.counter, self.value, self.bound = counter, value, bound
        shown = value if isinstance(value, int | float) and not isinstance(value, bool) else ascii(value)[:80]
        super().__init__(f"{counter} = {shown}: {bound}")


def metric_name(counter: str, label: str | None = None) -> str:
    """The counter's /metrics name (``sglang:ddtree_counterfactual_accepted_tokens_total{budget="16"}``)."""
    base = f"{PREFIX}{counter}_total"
    return base if label is None else f'{base}{{budget="{label}"}}'


@dataclass(frozen=True)
class CandidateCounts:
    accepted_tokens: int
    accepted_tokens_squared: int
    round_weight: float
    accepted_tokens_x_real: int


@dataclass(frozen=True)
class Counters:
    """Counters that passed every check: whole numbers, canonical labels (chain first, then by budget)."""

    rounds_scored: int
    rounds_sampled: int
    rounds_dropped: int
    rounds_discarded: int
    real_emitted_tokens: int
    real_emitted_tokens_squared: int
    candidates: dict[str, CandidateCounts] = field(default_factory=dict)
    horizon: int = UNKNOWN_HORIZON

    def to_counts(self) -> dict[str, Any]:
        """The counts as readers store them (``{"rounds_scored": ..., "budgets": {label: {...}}}``)."""
        out: dict[str, Any] = {k: getattr(self, k) for k in ROUND_COUNTERS}
        out["budgets"] = {label: {k: getattr(c, k) for k in CANDIDATE_COUNTERS}
                          for label, c in self.candidates.items()}  # fmt: skip
        return out

    def paired(self, label: str) -> tuple[int, int]:
        """(sum d, sum d^2) of d = (accepted + 1) - real tokens, round by round, for one candidate."""
        c, n, r = self.candidates[label], self.rounds_scored, self.real_emitted_tokens
        d_sum = c.accepted_tokens + n - r
        d_sq = (c.accepted_tokens_squared + n + self.real_emitted_tokens_squared + 2 * c.accepted_tokens
                - 2 * c.accepted_tokens_x_real - 2 * r)  # fmt: skip
        return d_sum, d_sq


def counts_from_snapshot(snapshot: Mapping[str, Any]) -> dict[str, Any]:
    """The scorer's ``snapshot()`` in the readers' counts (what its /metrics says)."""
    out: dict[str, Any] = {
        "rounds_scored": snapshot["rounds_scored"], "rounds_sampled": snapshot["rounds_sampled"],
        "rounds_dropped": snapshot["rounds_dropped"], "rounds_discarded": snapshot["rounds_discarded"],
        "real_emitted_tokens": snapshot["real_emitted"],
        "real_emitted_tokens_squared": snapshot["real_emitted_sq"],
    }  # fmt: skip
    out["budgets"] = {
        c["label"]: {"accepted_tokens": c["accepted"], "accepted_tokens_squared": c["accepted_sq"],
                     "round_weight": c["round_weight"], "accepted_tokens_x_real": c["accepted_x_real"]}
        for c in snapshot["candidates"]
    }  # fmt: skip
    return out


def _count(value: Any, name: str, *, whole: bool = True) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EvidenceError(name, value, "not a number")
    if not math.isfinite(value):
        raise EvidenceError(name, value, "a counter is a finite number")
    if value < 0:
        raise EvidenceError(name, value, "a counter is >= 0")
    if value >= MAX_COUNT:
        raise EvidenceError(name, value, f"above 2^53 = {MAX_COUNT}: no server counts that far")
    if whole:
        if value != int(value):
            raise EvidenceError(name, value, "a count of tokens or rounds is a whole number")
        return int(value)
    return float(value)


def _at_most(name: str, value: float, bound: float, why: str) -> None:
    if value > bound:
        raise EvidenceError(name, value, f"above {bound:g}, {why}")


def _at_least(name: str, value: float, bound: float, why: str) -> None:
    if value < bound:
        raise EvidenceError(name, value, f"below {bound:g}, {why}")


def _slack(x: float) -> float:
    return abs(x) * _REL + 1e-9


def _per_round_max(label: str, horizon: int) -> int:
    return horizon if label == CHAIN else min(int(label), horizon)


def _order(label: str) -> int:
    return -1 if label == CHAIN else int(label)


def check_counters(counts: Mapping[str, Any], *, horizon: int | None = None,
                   running: str | None = None) -> Counters:  # fmt: skip
    """``counts`` (``{"rounds_scored", ..., "budgets": {label: {...}}}``) checked against every invariant
    of the module doc; ``horizon``: the drafter's L (None: unknown, the loosest bound); ``running``: the
    canonical label of the setting the server decodes with, when known and among the candidates (its
    paired difference must be 0). Returns the checked :class:`Counters`; raises :class:`EvidenceError`."""
    if not isinstance(counts, Mapping):
        raise EvidenceError("counts", counts, "not an object of counters")
    L = UNKNOWN_HORIZON if horizon is None else int(horizon)
    if not 1 <= L <= UNKNOWN_HORIZON:
        raise EvidenceError("horizon", horizon, f"the drafter's horizon is 1..{UNKNOWN_HORIZON}")
    rounds: dict[str, int] = {}
    for k in ROUND_COUNTERS:
        if k not in counts:
            raise EvidenceError(metric_name(k), None, "missing: a scorer reports all six round counters")
        rounds[k] = _count(counts[k], metric_name(k))
    budgets = counts.get("budgets")
    if not isinstance(budgets, Mapping) or not budgets:
        raise EvidenceError(metric_name("accepted_tokens"), budgets, "no candidate budget at all")
    if len(budgets) > MAX_CANDIDATES:
        raise EvidenceError(metric_name("accepted_tokens"), len(budgets),
                            f"more than {MAX_CANDIDATES} candidate labels")  # fmt: skip
    cands: dict[str, CandidateCounts] = {}
    for raw, c in budgets.items():
        try:
            label = parse_label(raw, what="counterfactual budget label")
        except SettingsError as exc:
            raise EvidenceError(metric_name("accepted_tokens"), raw, str(exc)) from None
        if not isinstance(c, Mapping):
            raise EvidenceError(metric_name("accepted_tokens", label), c, "not an object of counters")
        values = {}
        for k in CANDIDATE_COUNTERS:
            if k not in c:
                raise EvidenceError(metric_name(k, label), None, "missing: a scorer reports four per budget")
            values[k] = _count(c[k], metric_name(k, label), whole=k != "round_weight")
        cands[label] = CandidateCounts(**values)
    out = Counters(**rounds, candidates=dict(sorted(cands.items(), key=lambda kv: _order(kv[0]))), horizon=L)
    _check_rounds(out)
    for label in out.candidates:
        _check_candidate(out, label)
    _check_nesting(out)
    if running is not None and running in out.candidates:
        _check_running(out, running)
    return out


def _check_rounds(c: Counters) -> None:
    n, s, r = c.rounds_scored, c.rounds_sampled, c.real_emitted_tokens
    rs, top = c.real_emitted_tokens_squared, c.horizon + 1
    taken = n + c.rounds_dropped + c.rounds_discarded
    _at_least(metric_name("rounds_sampled"), s, taken,
              f"the rounds scored ({n}), dropped ({c.rounds_dropped}) and discarded ({c.rounds_discarded}): "
              "each was sampled first")  # fmt: skip
    name = metric_name("real_emitted_tokens")
    _at_least(name, r, n, f"the {n} rounds scored: a round emits at least one token")
    _at_most(name, r, n * top, f"{n} rounds x {top}: a round emits at most the drafter's block (horizon + 1)")
    name = metric_name("real_emitted_tokens_squared")
    _at_least(name, rs, r, f"sum r = {r}: r^2 >= r for every round")
    _at_most(name, rs, top * r, f"{top} x sum r = {r}: r <= {top} every round")
    if n:
        _at_least(name, rs, r * r / n, f"(sum r)^2 / rounds = {r}^2 / {n}: a variance is never negative")


def _check_candidate(c: Counters, label: str) -> None:
    x, n, r, rs, top = (c.candidates[label], c.rounds_scored, c.real_emitted_tokens,
                        c.real_emitted_tokens_squared, c.horizon + 1)  # fmt: skip
    m = _per_round_max(label, c.horizon)
    what = "the chain" if label == CHAIN else f"a budget-{label} tree"
    a, q, w, ar = x.accepted_tokens, x.accepted_tokens_squared, x.round_weight, x.accepted_tokens_x_real
    name = metric_name("accepted_tokens", label)
    _at_most(name, a, n * m,
             f"{n} rounds x {m}: {what} accepts at most {m} drafted tokens a round (horizon {c.horizon})")
    name = metric_name("accepted_tokens_squared", label)
    _at_least(name, q, a, f"sum a = {a}: a^2 >= a for whole a")
    _at_most(name, q, m * a, f"{m} x sum a = {a}: a <= {m} every round")
    if n:
        _at_least(name, q, a * a / n, f"(sum a)^2 / rounds = {a}^2 / {n}: a variance is never negative")
    name = metric_name("accepted_tokens_x_real", label)
    _at_least(name, ar, a, f"sum a = {a}: every round emits r >= 1 tokens")
    _at_most(name, ar, top * a, f"{top} x sum a = {a}: r <= {top} every round")
    cov = n * ar - a * r  # n^2 x the covariance of a and r over the rounds
    if cov * cov > (n * q - a * a) * (n * rs - r * r):
        raise EvidenceError(name, ar, f"it implies a covariance of a and r ({cov / max(n * n, 1):g}) beyond "
                            "what their spreads allow (Cauchy-Schwarz): no rounds give it")  # fmt: skip
    name = metric_name("round_weight", label)
    _at_most(name, w, r + _slack(r), f"sum r = {r}: each round weighs r / (a + 1) <= r")
    low = r / (m + 1)
    _at_least(name, w, low - _slack(low), f"sum r / {m + 1} = {low:g}: a <= {m} every round")
    if r:
        low = r * r / (ar + r)
        _at_least(name, w, low - _slack(low),
                  f"(sum r)^2 / (sum a r + sum r) = {low:g} (Cauchy-Schwarz): no rounds give this weight "
                  "with this cross term")  # fmt: skip
    d_sum, d_sq = c.paired(label)
    if d_sq < 0 or n * d_sq < d_sum * d_sum:
        raise EvidenceError(metric_name("accepted_tokens_x_real", label), ar,
                            f"the paired difference d = a + 1 - r would have sum {d_sum} and sum of squares "
                            f"{d_sq} over {n} rounds: no rounds give that")  # fmt: skip


def _check_nesting(c: Counters) -> None:
    trees = [label for label in c.candidates if label != CHAIN]
    for small, large in itertools.pairwise(trees):
        s, g = c.candidates[small], c.candidates[large]
        why = (f"budget {small}'s on the same rounds: best-first trees are nested, so budget {large} "
               f"accepts at least what budget {small} does")  # fmt: skip
        for k in ("accepted_tokens", "accepted_tokens_squared", "accepted_tokens_x_real"):
            _at_least(metric_name(k, large), getattr(g, k), getattr(s, k), f"{k} of {why}")
        _at_most(metric_name("round_weight", large), g.round_weight, s.round_weight + _slack(s.round_weight),
                 f"round_weight of {why} (and needs no more rounds)")  # fmt: skip


def _check_running(c: Counters, label: str) -> None:
    d_sum, d_sq = c.paired(label)
    if d_sum or d_sq:
        x = c.candidates[label]
        raise EvidenceError(
            metric_name("accepted_tokens", label), x.accepted_tokens,
            f"the server runs {label}, so on every scored round its candidate accepts what the real round "
            f"did (accepted + 1 = real tokens); these differ from the real rounds (sum of differences "
            f"{d_sum}, of squares {d_sq}): they are not this server's, or it does not run {label}",
        )
