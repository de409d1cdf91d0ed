"""``sglang:ddtree_counterfactual_*`` on SGLang's ``/metrics``: the series the lab engine renders and the
readers parse (``core/counterfactual_invariants``: the names; ``health/counterfactual_counters``: the reader
``ddtree tune --url`` and ``ddtree metrics record-counterfactual`` use), so they read a real server unchanged.

The scorer lives in the scheduler process and ``/metrics`` is served by another: SGLang runs prometheus_client
in multiprocess mode, where a counter's value travels through its per-process file (as ``handshake.py``'s
gauges do). The counters are therefore prometheus ``Counter`` objects advanced by the difference between two
snapshots of the scorer. Only one rank of a tensor-parallel group publishes (every rank scores the same
rounds); data-parallel groups score different requests and add up.
"""

from __future__ import annotations

from typing import Any

from ddtree_runtime.core.counterfactual_invariants import PREFIX

# The readers' counter name (core/counterfactual_invariants: ROUND_COUNTERS, CANDIDATE_COUNTERS; held equal
# by tests/unit/test_counterfactual_hook.py) -> (the scorer snapshot's key, help); each a counter (``_total``
# on the wire).
ROUNDS = {
    "rounds_scored": ("rounds_scored", "Sampled rounds scored for every candidate budget"),
    "rounds_sampled": ("rounds_sampled", "Rounds sampled for counterfactual scoring"),
    "rounds_dropped": (
        "rounds_dropped", "Sampled rounds dropped: the request's ring of pending rounds was full"
    ),
    "rounds_discarded": (
        "rounds_discarded", "Sampled rounds discarded: the request ended before they resolved"
    ),
    "real_emitted_tokens": ("real_emitted", "Tokens the scored rounds emitted for real (accepted + bonus)"),
    "real_emitted_tokens_squared": (
        "real_emitted_sq", "Sum over scored rounds of the squared real tokens (for the spread)"
    ),
}  # fmt: skip
PER_BUDGET = {
    "accepted_tokens": (
        "accepted", "Drafted tokens each candidate budget would have accepted on the scored rounds"
    ),
    "accepted_tokens_squared": (
        "accepted_sq", "Sum over scored rounds of the squared accepted count (for the spread)"
    ),
    "round_weight": (
        "round_weight", "Sum over scored rounds of real tokens / (candidate accepted + 1): the rounds the "
        "candidate would have needed for those tokens",
    ),
    "accepted_tokens_x_real": (
        "accepted_x_real", "Sum over scored rounds of accepted x real tokens (paired spread against the "
        "running setting)",
    ),
}  # fmt: skip


def series_values(snapshot: dict[str, Any]) -> dict[tuple[str, str | None], float]:
    """``{(counter, budget label or None): value}`` of a scorer snapshot."""
    out: dict[tuple[str, str | None], float] = {}
    for counter, (key, _) in ROUNDS.items():
        out[(counter, None)] = float(snapshot[key])
    for counter, (key, _) in PER_BUDGET.items():
        for cand in snapshot["candidates"]:
            out[(counter, cand["label"])] = float(cand[key])
    return out


class CounterfactualMetrics:
    """The counters in prometheus_client's registry (SGLang's, multiprocess-aware), label ``model_name`` as
    the lab engine's, plus ``budget`` per candidate."""

    def __init__(self, model_name: str, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter

        registry = REGISTRY if registry is None else registry
        self.model_name = model_name
        self.rounds = {
            c: Counter(PREFIX + c, doc, ["model_name"], registry=registry) for c, (_, doc) in ROUNDS.items()
        }
        self.per_budget = {
            c: Counter(PREFIX + c, doc, ["model_name", "budget"], registry=registry)
            for c, (_, doc) in PER_BUDGET.items()
        }
        self._last: dict[tuple[str, str | None], float] = {}

    def update(self, snapshot: dict[str, Any]) -> None:
        """Advance each counter to the snapshot's value (a counter only grows: a smaller value, which a stale
        snapshot would give, is skipped). Every series exists from the first publish, zeros included."""
        for (counter, label), value in series_values(snapshot).items():
            if label is None:
                child = self.rounds[counter].labels(model_name=self.model_name)
            else:
                child = self.per_budget[counter].labels(model_name=self.model_name, budget=label)
            delta = value - self._last.get((counter, label), 0.0)
            if delta > 0:
                child.inc(delta)
                self._last[(counter, label)] = value
