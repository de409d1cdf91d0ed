"""An adaptive server's width choice as it publishes it, read back on the host: ``/server_info``'s
``internal_states[i].ddtree_widths`` (``core/width_policy.WidthChooser.to_dict``: the widths, whether it is
still exploring, the table batch size -> width, each width's own tokens per round, observed request-rounds and
rounds run) and the /metrics series ``sglang:ddtree_width_rounds_total{width}`` (rounds each width ran) and
``sglang:ddtree_width_tokens_per_round{width}`` (a width's own observed mean). Checked field by field
(WidthStateError names the first bad one) and shown compactly for ``ddtree fleet status``, ``ddtree tune`` and
the live probe's report. Host side: stdlib + prometheus_client's text parser (/metrics only).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ddtree_runtime.core.decoder_settings import MAX_WIDTHS, SettingsError, parse_label

ROUNDS_METRIC = "sglang:ddtree_width_rounds_total"
TOKENS_METRIC = "sglang:ddtree_width_tokens_per_round"
MAX_BATCH = 4096
MAX_COUNT = 10**15


class WidthStateError(ValueError):
    """A width state no server publishes: one line naming the field, the value and the rule."""


def _order(width: str) -> tuple[int, int]:
    return (0, 0) if width == "chain" else (1, int(width))


@dataclass(frozen=True)
class WidthState:
    """One scheduler's width choice (the wire form's fields, checked)."""

    widths: tuple[str, ...]
    exploring: bool
    table: Mapping[int, str]  # captured batch size -> the width its rounds verify (empty while exploring)
    tokens_per_round: Mapping[str, float]
    observed_rows: Mapping[str, int]
    rounds: Mapping[str, int]

    def table_text(self) -> str:
        """The table by runs of batch sizes that verify the same width, ``1-4:15 8-16:31`` (``exploring``
        while every width still runs on its own rounds)."""
        if self.exploring or not self.table:
            return "exploring"
        runs: list[list[Any]] = []  # [first size, last size, width]
        for size in sorted(self.table):
            if runs and runs[-1][2] == self.table[size]:
                runs[-1][1] = size
            else:
                runs.append([size, size, self.table[size]])
        return " ".join(f"{a}:{w}" if a == b else f"{a}-{b}:{w}" for a, b, w in runs)

    def rounds_text(self) -> str:
        """Rounds each width ran, ``15:1200 31:340``."""
        return " ".join(f"{w}:{self.rounds.get(w, 0)}" for w in self.widths)

    def to_dict(self) -> dict[str, Any]:
        return {"widths": list(self.widths), "exploring": self.exploring,
                "table": {str(size): w for size, w in sorted(self.table.items())},
                "tokens_per_round": dict(self.tokens_per_round), "observed_rows": dict(self.observed_rows),
                "rounds": dict(self.rounds)}  # fmt: skip


def _width(value: Any, where: str) -> str:
    try:
        return parse_label(value, what=where)
    except SettingsError as exc:
        raise WidthStateError(str(exc)) from None


def _mapping(doc: Mapping[str, Any], key: str, where: str) -> Mapping[Any, Any]:
    value = doc.get(key)
    if not isinstance(value, dict):
        raise WidthStateError(f"{where}.{key} is {ascii(value)[:60]}, not an object")
    return value


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        raise WidthStateError(f"{where} is {ascii(value)[:60]}, not a count")
    return value


def _per_width(doc: Mapping[str, Any], key: str, widths: tuple[str, ...], where: str) -> dict[str, Any]:
    out = {}
    for raw, value in _mapping(doc, key, where).items():
        width = _width(raw, f"{where}.{key} key")
        if width not in widths:
            raise WidthStateError(f"{where}.{key} names width {width}, not one of {list(widths)}")
        out[width] = value
    return out


def parse_width_state(doc: Any, *, where: str = "ddtree_widths") -> WidthState:
    """A published width state, checked (WidthStateError names the first bad field)."""
    if not isinstance(doc, dict):
        raise WidthStateError(f"{where} is {type(doc).__name__}, not an object")
    raw = doc.get("widths")
    if not isinstance(raw, list) or not 2 <= len(raw) <= MAX_WIDTHS:
        raise WidthStateError(f"{where}.widths is {ascii(raw)[:60]}: want a list of 2..{MAX_WIDTHS} widths")
    widths = tuple(_width(w, f"{where}.widths[{i}]") for i, w in enumerate(raw))
    if len(set(widths)) != len(widths):
        raise WidthStateError(f"{where}.widths {list(widths)} names a width twice")
    exploring = doc.get("exploring")
    if not isinstance(exploring, bool):
        raise WidthStateError(f"{where}.exploring is {ascii(exploring)[:60]}, not true or false")
    table: dict[int, str] = {}
    for size, width in _mapping(doc, "table", where).items():
        at = f"{where}.table[{ascii(size)[:20]}]"
        if not (isinstance(size, str) and size.isascii() and size.isdigit() and 1 <= int(size) <= MAX_BATCH):
            raise WidthStateError(f"{at}: the key is not a batch size 1..{MAX_BATCH}")
        table[int(size)] = _width(width, at)
        if table[int(size)] not in widths:
            raise WidthStateError(f"{at} is width {width}, not one of {list(widths)}")
    tokens = _per_width(doc, "tokens_per_round", widths, where)
    for width, value in tokens.items():
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or not 0 <= value <= 1 << 20:
            raise WidthStateError(f"{where}.tokens_per_round[{width}] is {ascii(value)[:60]}, not a number "
                                  "of tokens per round")  # fmt: skip
        tokens[width] = float(value)
    counts = {}
    for key in ("observed_rows", "rounds"):
        given = _per_width(doc, key, widths, where)
        counts[key] = {w: _count(v, f"{where}.{key}[{w}]") for w, v in given.items()}
    return WidthState(widths, exploring, table, tokens, counts["observed_rows"], counts["rounds"])


def width_metrics(text: str) -> dict[str, dict[str, float]]:
    """``{width: {"rounds": n, "tokens_per_round": x}}`` from a /metrics text (only the keys its series
    give; {} when the server publishes neither). ValueError for text that is not Prometheus' format or a
    width label that is not a setting label."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {ROUNDS_METRIC: "rounds", TOKENS_METRIC: "tokens_per_round"}
    out: dict[str, dict[str, float]] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises ValueError and others for text it cannot read
        raise ValueError(f"not Prometheus text format: {ascii(str(exc))[:160]}") from None
    for fam in families:
        for s in fam.samples:
            if s.name not in wanted or not math.isfinite(s.value):
                continue
            width = _width(s.labels.get("width"), f"{s.name} width label")
            out.setdefault(width, {})[wanted[s.name]] = s.value
    return dict(sorted(out.items(), key=lambda kv: _order(kv[0])))
