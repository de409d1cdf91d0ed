"""The lab server's /metrics: SGLang's metric names (prometheus_client), plus the DDTree handshake gauges."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServingMetrics:
    """One registry per server (not the global one), so several servers can live in one test process."""

    def __init__(self, model_name: str) -> None:
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

    def render(self) -> bytes:
        return generate_latest(self.registry)
