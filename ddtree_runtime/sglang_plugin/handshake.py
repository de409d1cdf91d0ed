"""The hidden-state handshake a probe reads: in ``/server_info`` and as ``sglang:ddtree_*`` metrics.

Shape (docs/interfaces.md section 3)::

    {"algorithm", "budget", "topk_cap", "block_size", "target_hidden_size", "target_layer_ids",
     "expected_hidden_width", "draft_fc_in_features", "target_hybrid", "observed_hidden_width", "status"}

``target_hybrid``: the target keeps recurrent state (GDN layers verified as a tree), None if unknown.

``status``: ``pending`` until the first target forward, then ``ok``, ``mismatch`` (a width other
than expected reached the drafter) or ``missing`` (the target returned no hidden states).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddtree_runtime.sglang_plugin.algorithm import PluginSettings

METRIC_NAMES = (
    "sglang:ddtree_expected_hidden_width",
    "sglang:ddtree_observed_hidden_width",
    "sglang:ddtree_budget",
)


def static_handshake(settings: PluginSettings) -> dict[str, Any]:
    """The handshake as known from the launch (files and flags), before any forward."""
    contract = settings.contract or {}
    layer_ids = contract.get("target_layer_ids")
    hidden = contract.get("target_hidden_size")
    expected = len(layer_ids) * hidden if layer_ids and hidden else None
    return {
        "algorithm": settings.algorithm,
        "budget": settings.decoder.budget,
        "topk_cap": settings.decoder.topk_cap,
        "block_size": settings.decoder.block_size,
        "target_hidden_size": hidden,
        "target_layer_ids": list(layer_ids) if layer_ids else None,
        "expected_hidden_width": expected,
        "draft_fc_in_features": contract.get("fc_in_features"),
        # SGLang's own classification from resolution (hybrid_kind; None: pure attention).
        "target_hybrid": settings.hybrid_kind is not None,
        "observed_hidden_width": None,
        "status": "pending",
    }


@dataclass
class HandshakeState:
    """Live handshake kept by the worker; updated after every target forward."""

    base: dict[str, Any]
    observed: int | None = None
    missing: bool = False
    forwards: int = field(default=0)

    def observe(self, hidden: Any) -> None:
        self.forwards += 1
        if hidden is None:
            self.missing = True
            return
        shape = getattr(hidden, "shape", ())
        self.observed = int(shape[-1]) if len(shape) else None

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.base)
        out["observed_hidden_width"] = self.observed
        expected = out.get("expected_hidden_width")
        if self.missing:
            out["status"] = "missing"
        elif self.observed is None:
            out["status"] = "pending"
        elif expected is not None and self.observed != expected:
            out["status"] = "mismatch"
        else:
            out["status"] = "ok"
        return out


class HandshakeMetrics:
    """``sglang:ddtree_*`` gauges beside SGLang's own (same registry, multiprocess-aware)."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Gauge

        registry = REGISTRY if registry is None else registry
        doc = {
            METRIC_NAMES[0]: "Hidden-state width the DDTREE drafter expects (target layers x hidden size).",
            METRIC_NAMES[1]: "Hidden-state width the target last handed the DDTREE drafter (0 = none yet).",
            METRIC_NAMES[2]: "DDTREE tree budget (non-root nodes per request and round).",
        }
        # "mostrecent": SGLang runs prometheus in multiprocess mode; the last writer wins.
        self.gauges = {
            name: Gauge(name, text, registry=registry, multiprocess_mode="mostrecent")
            for name, text in doc.items()
        }

    def update(self, handshake: dict[str, Any]) -> None:
        self.gauges[METRIC_NAMES[0]].set(handshake.get("expected_hidden_width") or 0)
        self.gauges[METRIC_NAMES[1]].set(handshake.get("observed_hidden_width") or 0)
        self.gauges[METRIC_NAMES[2]].set(handshake.get("budget") or 0)
