"""``sglang:ddtree_price_*`` on SGLang's ``/metrics``: the start-up price table (``price_table``) as gauges,
labelled ``width`` and ``batch_size``, in seconds (``core/round_prices.METRICS``). SGLang runs
prometheus_client in multiprocess mode; "mostrecent" keeps the last value written, as the handshake's
gauges do."""

from __future__ import annotations

from typing import Any

from ddtree_runtime.core.round_prices import METRIC_PREFIX, METRICS, PriceTable, metric_samples


class PriceMetrics:
    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Gauge

        registry = REGISTRY if registry is None else registry
        self.gauges = {
            METRIC_PREFIX + suffix: Gauge(METRIC_PREFIX + suffix, doc, ["width", "batch_size"],
                                          registry=registry, multiprocess_mode="mostrecent")
            for suffix, (doc, _) in METRICS.items()
        }  # fmt: skip

    def publish(self, table: PriceTable) -> None:
        for (name, width, bs), seconds in metric_samples(table).items():
            self.gauges[name].labels(width=width, batch_size=str(bs)).set(seconds)
