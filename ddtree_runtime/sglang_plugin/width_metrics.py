"""``sglang:ddtree_width_*`` on SGLang's ``/metrics`` for an adaptive server (``round/width_choice``): rounds
each width ran, each width's own tokens per round, and the width chosen per batch size."""

from __future__ import annotations

from typing import Any

from ddtree_runtime.core.width_policy import WidthChooser

ROUNDS = "sglang:ddtree_width_rounds"  # a counter: prometheus_client exposes it as ..._total
TOKENS = "sglang:ddtree_width_tokens_per_round"
CHOSEN = "sglang:ddtree_width_chosen_budget"


class WidthMetrics:
    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = REGISTRY if registry is None else registry
        self.rounds = Counter(ROUNDS, "DDTREE decode rounds each verify width (budget) ran.", ["width"],
                              registry=registry)  # fmt: skip
        self.tokens = Gauge(TOKENS, "DDTREE tokens emitted per request and round, by the width's own rounds.",
                            ["width"], registry=registry, multiprocess_mode="mostrecent")  # fmt: skip
        doc = "DDTREE budget an adaptive server verifies at this batch size (0: still exploring)."
        self.chosen = Gauge(CHOSEN, doc, ["batch_size"], registry=registry, multiprocess_mode="mostrecent")
        self._counted: dict[str, int] = {}

    def publish(self, chooser: WidthChooser) -> None:
        for width, n in chooser.rounds_run.items():
            delta = n - self._counted.get(width, 0)
            if delta > 0:
                self.rounds.labels(width=width).inc(delta)
                self._counted[width] = n
        for width, (mean, _) in chooser.observed.items():
            self.tokens.labels(width=width).set(mean)
        table = chooser.policy.table if chooser.policy is not None else {}
        for size in sorted({s for _, s in chooser.prices}):
            self.chosen.labels(batch_size=str(size)).set(int(table[size]) if size in table else 0)
