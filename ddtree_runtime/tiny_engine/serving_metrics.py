"""The lab server's /metrics: SGLang's metric names (prometheus_client), plus the DDTree handshake gauges."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServingMetrics:
    """One registry per server (not the global one), so several servers can live in one test process."""

    def __init__(self, model_name: str, counterfactual: Callable[[], dict | None] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name}
        names = list(self.labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=self.registry).labels(**self.labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=self.registry).labels(**self.labels)

        self.spec_accept_length = gauge(
            "sglang:spec_accept_length", "Average accepted tokens per verify step"
        )
        self.spec_accept_rate = gauge(
            "sglang:spec_accept_rate", "Accepted draft tokens / proposed draft tokens"
        )
        self.spec_num_draft_tokens = gauge(
            "sglang:spec_num_draft_tokens", "Tokens verified per request per step"
        )
        self.spec_verify_calls = counter(
            "sglang:spec_verify_calls", "Speculative verify forwards (per request)"
        )
        self.num_running_reqs = gauge("sglang:num_running_reqs", "Running requests")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "Queued requests")
        self.gen_throughput = gauge("sglang:gen_throughput", "Generation throughput (token/s)")
        self.token_usage = gauge("sglang:token_usage", "KV pool token usage")
        self.max_total_num_tokens = gauge("sglang:max_total_num_tokens", "KV pool size in tokens")
        self.generation_tokens = counter("sglang:generation_tokens", "Generated tokens")
        self.prompt_tokens = counter("sglang:prompt_tokens", "Prompt tokens")
        self.num_requests = counter("sglang:num_requests", "Finished requests")
        self.e2e_latency = Histogram(
            "sglang:e2e_request_latency_seconds",
            "End-to-end request latency",
            names,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(**self.labels)
        self.expected_hidden_width = gauge(
            "sglang:ddtree_expected_hidden_width", "Hidden width the drafter's fc expects (k x H)"
        )
        self.observed_hidden_width = gauge(
            "sglang:ddtree_observed_hidden_width", "Hidden width the target handed over (0 = none yet)"
        )
        self.budget = gauge("sglang:ddtree_budget", "DDTree node budget (non-root nodes)")
        if counterfactual is not None:
            self.registry.register(CounterfactualCollector(counterfactual, self.labels))

    def render(self) -> bytes:
        return generate_latest(self.registry)


# name suffix (after sglang:ddtree_counterfactual_) -> help; each a counter (``_total`` on the wire)
COUNTERFACTUAL_ROUNDS = {
    "rounds_scored": "Sampled rounds scored for every candidate budget",
    "rounds_sampled": "Rounds sampled for counterfactual scoring",
    "rounds_dropped": "Sampled rounds dropped: the request's ring of pending rounds was full",
    "rounds_discarded": "Sampled rounds discarded: the request ended before they resolved",
    "real_emitted_tokens": "Tokens the scored rounds emitted for real (accepted + bonus)",
    "real_emitted_tokens_squared": "Sum over scored rounds of the squared real tokens (for the spread)",
}
COUNTERFACTUAL_PER_BUDGET = {
    "accepted_tokens": "Drafted tokens each candidate budget would have accepted on the scored rounds",
    "accepted_tokens_squared": "Sum over scored rounds of the squared accepted count (for the spread)",
    "round_weight": "Sum over scored rounds of real tokens / (candidate accepted + 1): the rounds the "
    "candidate would have needed for those tokens",
    "accepted_tokens_x_real": "Sum over scored rounds of accepted x real tokens (paired spread against "
    "the running setting)",
}


class CounterfactualCollector:
    """Counters from the scorer's snapshot at each scrape (absolute values, so a custom collector)."""

    def __init__(self, snapshot: Callable[[], dict | None], labels: dict[str, str]) -> None:
        self.snapshot, self.labels = snapshot, labels

    def describe(self) -> list[Metric]:
        return []  # no fixed families: none until the first scored round

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        if snap is None:
            return
        names, values = list(self.labels), list(self.labels.values())
        keys = {"real_emitted_tokens": "real_emitted", "real_emitted_tokens_squared": "real_emitted_sq"}
        for suffix, doc in COUNTERFACTUAL_ROUNDS.items():
            fam = CounterMetricFamily(f"sglang:ddtree_counterfactual_{suffix}", doc, labels=names)
            fam.add_metric(values, float(snap[keys.get(suffix, suffix)]))
            yield fam
        fields = {"accepted_tokens": "accepted", "accepted_tokens_squared": "accepted_sq",
                  "round_weight": "round_weight", "accepted_tokens_x_real": "accepted_x_real"}  # fmt: skip
        for suffix, doc in COUNTERFACTUAL_PER_BUDGET.items():
            name = f"sglang:ddtree_counterfactual_{suffix}"
            fam = CounterMetricFamily(name, doc, labels=[*names, "budget"])
            for cand in snap["candidates"]:
                fam.add_metric([*values, cand["label"]], float(cand[fields[suffix]]))
            yield fam
