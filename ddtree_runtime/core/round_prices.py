"""A server's own round prices: seconds per decode round of the whole batch, split into the target's verify
and the rest of the round, per (width, batch size). Stdlib only: the SGLang plugin builds and publishes it
(``sglang_plugin/price_table.py``), the host side reads it back from ``/server_info``
(``health/sglang_client.server_prices``) and ``ddtree tune`` prices rounds with it (docs/price-table.md).

A width is the setting label of the verify width the round ran (``decoder_settings.parse_label``: a budget,
or ``chain``); a top-K cap changes the tree's shape, not the round's, so a capped tree is priced under its
budget. Keyed by (width, batch size) so a server that runs several widths publishes one table.

The wire form, in ``/server_info``'s ``internal_states[i].ddtree_prices``::

    {"unit": "seconds", "method": "graphs" | "eager", "repeats": 5, "measure_s": 1.2,
     "entries": [{"width": "16", "batch_size": 1, "verify_s": 0.0121, "rest_s": 0.0043}, ...]}
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ddtree_runtime.core.decoder_settings import SettingsError, parse_label

UNIT = "seconds"
# Replayed CUDA graphs, or eager forwards (no graphs: CPU, --disable-cuda-graph).
METHODS = ("graphs", "eager")
MAX_ENTRIES = 4096
MAX_BATCH = 4096
MAX_REPEATS = 1000
MAX_SECONDS = 3600.0  # a round slower than an hour is no price, it is a broken measurement


class PriceTableError(ValueError):
    """A price table no server publishes: one line naming the field, the value and the rule."""


@dataclass(frozen=True)
class RoundPrice:
    """One (width, batch size): the median seconds of the target's verify and of the rest of the round."""

    verify_s: float
    rest_s: float

    @property
    def round_s(self) -> float:
        return self.verify_s + self.rest_s


@dataclass(frozen=True)
class PriceTable:
    prices: Mapping[tuple[str, int], RoundPrice]
    method: str
    repeats: int
    measure_s: float = 0.0  # start-up seconds spent measuring

    def widths(self) -> list[str]:
        return sorted({w for w, _ in self.prices}, key=_width_order)

    def batch_sizes(self, width: str) -> list[int]:
        return sorted(b for w, b in self.prices if w == width)

    def round_ms(self) -> dict[str, dict[int, float]]:
        """``{width: {batch size: ms per round}}``: ``ddtree tune``'s round-cost table shape."""
        out: dict[str, dict[int, float]] = {}
        for (width, bs), price in self.prices.items():
            out.setdefault(width, {})[bs] = price.round_s * 1e3
        return out

    def to_dict(self) -> dict[str, Any]:
        entries = [
            {"width": w, "batch_size": b, "verify_s": p.verify_s, "rest_s": p.rest_s}
            for (w, b), p in sorted(self.prices.items(), key=lambda kv: (_width_order(kv[0][0]), kv[0][1]))
        ]
        return {"unit": UNIT, "method": self.method, "repeats": self.repeats,
                "measure_s": self.measure_s, "entries": entries}  # fmt: skip


def _width_order(width: str) -> tuple[int, int]:
    return (0, 0) if width == "chain" else (1, int(width))


def width_label(budget: int, *, chain: bool) -> str:
    """The width a round of this budget is priced under (module doc: a cap does not change it)."""
    return "chain" if chain else parse_label(str(budget), what="verify width")


def _seconds(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PriceTableError(f"{where} is {ascii(value)[:60]}, not a finite number of seconds")
    if not 0 < value <= MAX_SECONDS:
        raise PriceTableError(f"{where} is {value!r}: a price is in (0, {MAX_SECONDS:g}] seconds")
    return float(value)


def _whole(value: Any, where: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise PriceTableError(f"{where} is {ascii(value)[:60]}, not a whole number in {low}..{high}")
    return value


def parse_price_table(doc: Any, *, where: str = "ddtree_prices") -> PriceTable:
    """A published table, checked field by field (PriceTableError names the first bad one)."""
    if not isinstance(doc, dict):
        raise PriceTableError(f"{where} is {type(doc).__name__}, not an object")
    if doc.get("unit") != UNIT:
        raise PriceTableError(f"{where}.unit is {ascii(doc.get('unit'))[:60]}, not {UNIT!r}")
    method = doc.get("method")
    if method not in METHODS:
        raise PriceTableError(f"{where}.method is {ascii(method)[:60]}, not one of {', '.join(METHODS)}")
    repeats = _whole(doc.get("repeats"), f"{where}.repeats", 1, MAX_REPEATS)
    measure = doc.get("measure_s", 0.0)
    if isinstance(measure, bool) or not isinstance(measure, int | float) or not 0 <= measure <= 86400:
        raise PriceTableError(f"{where}.measure_s is {ascii(measure)[:60]}, not seconds in 0..86400")
    entries = doc.get("entries")
    if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_ENTRIES:
        shown = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise PriceTableError(f"{where}.entries is {shown}: want a list of 1..{MAX_ENTRIES} prices")
    prices: dict[tuple[str, int], RoundPrice] = {}
    for i, entry in enumerate(entries):
        at = f"{where}.entries[{i}]"
        if not isinstance(entry, dict):
            raise PriceTableError(f"{at} is {type(entry).__name__}, not an object")
        try:
            width = parse_label(entry.get("width"), what=f"{at}.width")
        except SettingsError as exc:
            raise PriceTableError(str(exc)) from None
        bs = _whole(entry.get("batch_size"), f"{at}.batch_size", 1, MAX_BATCH)
        if (width, bs) in prices:
            raise PriceTableError(f"{at}: width {width} at batch size {bs} is priced twice")
        prices[(width, bs)] = RoundPrice(_seconds(entry.get("verify_s"), f"{at}.verify_s"),
                                         _seconds(entry.get("rest_s"), f"{at}.rest_s"))  # fmt: skip
    return PriceTable(prices, method, repeats, float(measure))


# On /metrics (the SGLang plugin's gauges, labelled width and batch_size): name -> (help, the price's part).
METRIC_PREFIX = "sglang:ddtree_price_"
METRICS: dict[str, tuple[str, str]] = {
    "verify_seconds": ("Start-up median seconds of the target's tree verify of one round of the whole batch",
                       "verify_s"),
    "rest_seconds": ("Start-up median seconds of the rest of one round (drafter block, tree plan, accept) of "
                     "the whole batch", "rest_s"),
    "round_seconds": ("Start-up median seconds of one decode round of the whole batch (verify + rest)",
                      "round_s"),
}  # fmt: skip


def metric_samples(table: PriceTable) -> dict[tuple[str, str, int], float]:
    """``{(metric name, width, batch size): seconds}`` for every price and every series of :data:`METRICS`."""
    out: dict[tuple[str, str, int], float] = {}
    for (width, bs), price in table.prices.items():
        for suffix, (_, part) in METRICS.items():
            out[(METRIC_PREFIX + suffix, width, bs)] = float(getattr(price, part))
    return out
