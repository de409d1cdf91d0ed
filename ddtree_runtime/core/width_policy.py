"""Which verify width pays at each batch size (issue 41, "The width follows the batch"): per captured
batch size, the width whose expected tokens per second is highest, from each width's expected tokens per
round (blended with a prior until enough rounds are counted) over what a round of that width costs at
that batch size (the server's own price table).

Which counts to feed it: a width's own rounds where it ran (its own score is exact), and for a width
that has not run, the counterfactual estimate only as its prior. Off-policy estimates run 3-7 % low
(docs/counterfactual-acceptance.md, "Why the estimate runs low"), which would hold a server on the
width it started with.

The answer is a host table, batch size -> width, recomputed between rounds from counts the host already
holds; a round looks its batch size up (the bucket it pads into), so choosing reads nothing from the
device. A switch needs a margin over the width in place, so noise in the estimates does not flip the
width every update.

Standard library only: the planner and the operator tools read the same rule.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_PRIOR_ROUNDS = 200  # a prior counts as this many scored rounds (docs/counterfactual-acceptance.md)
DEFAULT_MARGIN = 0.02  # a new width must beat the one in place by 2 % of tokens/s


class WidthPolicyError(ValueError):
    """Widths, priors or prices that no choice can be made from; the message says which and why."""


def _positive(name: str, value: float) -> float:
    if not (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    ):
        raise WidthPolicyError(f"{name} = {value!r}: must be a finite number above 0")
    return float(value)


def blended_tokens(prior: float, observed: float | None, rounds: int, prior_rounds: int) -> float:
    """Expected tokens per round: the prior counted as ``prior_rounds`` rounds, the observed mean over
    ``rounds`` scored rounds (None or 0 rounds: the prior alone)."""
    prior = _positive("prior tokens per round", prior)
    if rounds < 0 or prior_rounds < 0:
        raise WidthPolicyError(f"rounds {rounds} and prior rounds {prior_rounds} must not be negative")
    if observed is None or rounds == 0:
        return prior
    observed = _positive("observed tokens per round", observed)
    if prior_rounds == 0:
        return observed
    return (prior * prior_rounds + observed * rounds) / (prior_rounds + rounds)


def best_width(tokens_per_round: Mapping[str, float], round_seconds: Mapping[str, float]) -> str:
    """The width with the most tokens per second among those priced (ties: the first in
    ``tokens_per_round``'s order, which callers give narrowest first)."""
    priced = [w for w in tokens_per_round if w in round_seconds]
    if not priced:
        raise WidthPolicyError(
            f"no width is both estimated ({sorted(tokens_per_round)}) and priced ({sorted(round_seconds)})"
        )
    rate = {w: tokens_per_round[w] / _positive(f"round seconds of {w}", round_seconds[w]) for w in priced}
    return max(priced, key=lambda w: (rate[w], -priced.index(w)))


@dataclass
class WidthPolicy:
    """The width per captured batch size. ``widths``: the labels the server can verify, narrowest first;
    ``priors``: expected tokens per round of each before any is scored (a profile's figures);
    ``prices``: seconds per round, ``{(width, batch size): s}``, for every captured batch size."""

    widths: tuple[str, ...]
    priors: Mapping[str, float]
    prices: Mapping[tuple[str, int], float]
    prior_rounds: int = DEFAULT_PRIOR_ROUNDS
    margin: float = DEFAULT_MARGIN
    table: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.widths or len(set(self.widths)) != len(self.widths):
            raise WidthPolicyError(f"widths {self.widths!r}: give at least one, each once")
        missing = [w for w in self.widths if w not in self.priors]
        if missing:
            raise WidthPolicyError(f"no prior tokens per round for {missing}: give one per width")
        for w in self.widths:
            _positive(f"prior tokens per round of {w}", self.priors[w])
        if not 0 <= self.margin < 1:
            raise WidthPolicyError(f"margin {self.margin!r}: must be in [0, 1)")
        sizes = self.batch_sizes()
        if not sizes:
            raise WidthPolicyError("the price table holds no batch size")
        for size in sizes:
            if not any((w, size) in self.prices for w in self.widths):
                raise WidthPolicyError(f"batch size {size} has no priced width among {list(self.widths)}")
        if not self.table:
            self.update({})

    def batch_sizes(self) -> list[int]:
        return sorted({size for (_, size) in self.prices})

    def expected_tokens(self, observed: Mapping[str, tuple[float, int]]) -> dict[str, float]:
        """Per width, the prior blended with ``observed[width] = (tokens per round, rounds scored)``."""
        return {
            w: blended_tokens(self.priors[w], *observed.get(w, (None, 0)), self.prior_rounds)
            for w in self.widths
        }

    def update(self, observed: Mapping[str, tuple[float, int]]) -> dict[int, str]:
        """The table from the latest counts; a batch size keeps its width unless another beats it by
        more than the margin. Returns the new table (also kept)."""
        tokens = self.expected_tokens(observed)
        new: dict[int, str] = {}
        for size in self.batch_sizes():
            cost = {w: self.prices[(w, size)] for w in self.widths if (w, size) in self.prices}
            best = best_width(tokens, cost)
            held = self.table.get(size)
            if held in cost and best != held:
                rate = {w: tokens[w] / cost[w] for w in (best, held)}
                if rate[best] <= rate[held] * (1 + self.margin):
                    best = held
            new[size] = best
        self.table = new
        return new

    def width_for(self, batch_size: int) -> str:
        """The width for a round of ``batch_size`` requests: its bucket's (the smallest captured batch
        size that holds it, as the round's graphs pad it)."""
        sizes = self.batch_sizes()
        at = bisect.bisect_left(sizes, batch_size)
        if batch_size < 1 or at == len(sizes):
            raise WidthPolicyError(f"batch size {batch_size}: outside the captured sizes 1..{sizes[-1]}")
        return self.table[sizes[at]]


DEFAULT_EXPLORE_ROWS = 256  # request-rounds each width runs before its own mean is trusted
DEFAULT_REVISIT_EVERY = 64  # one round in this many runs a width the table did not pick (keeps it measured)
# A width's mean follows traffic: request-rounds this many newer halve an older one's weight.
DEFAULT_HALF_LIFE_ROWS = 4096


@dataclass
class WidthChooser:
    """What an adaptive server's rounds ask (host only, no device read): :meth:`choose` the width for a
    round of ``batch_size`` requests, :meth:`observe` the cumulative tokens each width's rounds emitted
    (read back from the device asynchronously, with the request-rounds dispatched when the copy was
    made).

    First every width runs (the least-run width each round) until each has ``explore_rows`` observed
    request-rounds; then a :class:`WidthPolicy` on the widths' own means (no prior left: each was
    measured on its own rounds) and the server's prices picks per batch size, and one round in
    ``revisit_every`` runs the least-observed other width so an unpicked width's mean stays current as
    traffic changes."""

    widths: tuple[str, ...]
    prices: Mapping[tuple[str, int], float]
    explore_rows: int = DEFAULT_EXPLORE_ROWS
    revisit_every: int = DEFAULT_REVISIT_EVERY
    margin: float = DEFAULT_MARGIN
    half_life_rows: int = DEFAULT_HALF_LIFE_ROWS
    policy: WidthPolicy | None = None
    rounds: int = 0
    dispatched_rows: dict[str, int] = field(default_factory=dict)
    rounds_run: dict[str, int] = field(default_factory=dict)
    # per width: (its mean tokens per request-round, decayed by half_life_rows; request-rounds observed)
    observed: dict[str, tuple[float, int]] = field(default_factory=dict)
    _seen: dict[str, tuple[float, int]] = field(default_factory=dict, repr=False)  # last cumulative counts
    _decayed: dict[str, tuple[float, float]] = field(default_factory=dict, repr=False)  # (mean, weight)

    def __post_init__(self) -> None:
        if len(self.widths) < 2 or len(set(self.widths)) != len(self.widths):
            raise WidthPolicyError(f"widths {self.widths!r}: an adaptive server picks among 2 or more")
        for w in self.widths:
            if not any(width == w for width, _ in self.prices):
                raise WidthPolicyError(f"width {w} has no price: the server prices every width it can run")
        if self.explore_rows < 1 or self.revisit_every < 0 or self.half_life_rows < 1:
            raise WidthPolicyError(
                f"explore_rows {self.explore_rows} and half_life_rows {self.half_life_rows} must be at least "
                f"1, revisit_every {self.revisit_every} at least 0 (0: never)"
            )
        for w in self.widths:
            self.dispatched_rows.setdefault(w, 0)
            self.rounds_run.setdefault(w, 0)
        self._sizes = sorted({size for _, size in self.prices})

    @property
    def exploring(self) -> bool:
        return self.policy is None

    def choose(self, batch_size: int) -> str:
        """The width of the next round (``batch_size`` requests); counts it as dispatched."""
        if batch_size < 1:
            raise WidthPolicyError(f"batch size {batch_size}: a round has at least one request")
        self.rounds += 1
        if self.policy is None:
            width = min(self.widths, key=lambda w: (self.dispatched_rows[w], self.widths.index(w)))
        else:
            # Beyond the largest priced size the largest one's choice stands (the eager path's sizes).
            width = self.policy.width_for(min(batch_size, self._sizes[-1]))
            if self.revisit_every and self.rounds % self.revisit_every == 0:
                others = [w for w in self.widths if w != width]
                width = min(others, key=lambda w: (self.observed.get(w, (0.0, 0))[1], self.widths.index(w)))
        self.dispatched_rows[width] += batch_size
        self.rounds_run[width] += 1
        return width

    def observe(self, tokens: Mapping[str, float], rows: Mapping[str, int]) -> None:
        """Cumulative emitted tokens and request-rounds per width since start (``rows`` as dispatched when
        ``tokens`` was copied). Each width's mean moves toward what its rounds since the last call emitted,
        by their weight against ``half_life_rows``. Ends exploration once every width has ``explore_rows``;
        updates the table."""
        for w in self.widths:
            n, total = int(rows.get(w, 0)), float(tokens.get(w, 0))
            last_total, last_n = self._seen.get(w, (0.0, 0))
            fresh = n - last_n
            if fresh <= 0 or total < last_total:
                continue
            self._seen[w] = (total, n)
            # A weighted mean whose earlier rows' weight halves every half_life_rows newer ones: the running
            # average while few rows are in, a recent one once many are.
            mean, weight = self._decayed.get(w, (0.0, 0.0))
            weight *= 0.5 ** (fresh / self.half_life_rows)
            mean = (mean * weight + (total - last_total)) / (weight + fresh)
            self._decayed[w] = (mean, weight + fresh)
            self.observed[w] = (mean, n)
        if self.policy is None:
            if all(self.observed.get(w, (0.0, 0))[1] >= self.explore_rows for w in self.widths):
                means = {w: self.observed[w][0] for w in self.widths}
                self.policy = WidthPolicy(self.widths, means, self.prices, prior_rounds=0, margin=self.margin)
            return
        self.policy.update(self.observed)

    def to_dict(self) -> dict[str, object]:
        """What /server_info shows: the state, the table (batch size -> width), each width's own mean."""
        return {
            "widths": list(self.widths),
            "exploring": self.exploring,
            "table": {str(size): w for size, w in (self.policy.table if self.policy else {}).items()},
            "tokens_per_round": {w: round(m, 4) for w, (m, _) in self.observed.items()},
            "observed_rows": {w: n for w, (_, n) in self.observed.items()},
            "rounds": dict(self.rounds_run),
        }
