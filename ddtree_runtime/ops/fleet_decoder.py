"""What a host's last live probe says its server decodes with (``figures.setting`` and ``figures.decoder``,
``health/probe_server_info.record_decoder``), checked on the controller (a host's answer is not trusted) and
put in ``ddtree fleet status``'s words: the setting (``16``, ``chain``, ``auto(15,31)``), an adaptive server's
width per batch size and rounds per width, and the start-up round prices (ms per round)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ddtree_runtime.core.decoder_settings import SettingsError, parse_label
from ddtree_runtime.health.width_state import WidthStateError, parse_width_state

MAX_TEXT = 80


@dataclass(frozen=True)
class DecoderCells:
    """The table's three cells for one unit ('-' where the probe said nothing)."""

    setting: str | None = None
    widths: str | None = None  # "1-4:15 8-16:31; rounds 15:1200 31:340", or "refused: why"
    prices: str | None = None  # "15:22-61 31:27-87 ms (bs 1-16, graphs)", or "refused: why"

    def to_dict(self) -> dict[str, str | None]:
        return {"setting": self.setting, "widths": self.widths, "prices": self.prices}


def _text(value: Any) -> str | None:
    if not isinstance(value, str) or not value.isprintable():
        return None
    return value[:MAX_TEXT]


def _width_cell(doc: Any) -> str | None:
    if doc is None:
        return None
    try:
        state = parse_width_state(doc, where="decoder.width_state")
    except WidthStateError as exc:
        return f"refused: {str(exc)[:MAX_TEXT]}"
    return f"{state.table_text()}; rounds {state.rounds_text()}"


def _price_cell(doc: Any) -> str | None:
    """Per width the round's ms at the smallest and the largest priced batch size."""
    if doc is None:
        return None
    if not isinstance(doc, dict) or doc.get("method") not in ("graphs", "eager"):
        return "refused: not a price table (method graphs or eager)"
    table = doc.get("round_ms")
    if not isinstance(table, dict) or not table:
        return "refused: no round_ms per width"
    cells, sizes = [], set()
    for width in table:
        try:
            label = parse_label(width, what="a priced width")
        except SettingsError as exc:
            return f"refused: {str(exc)[:MAX_TEXT]}"
        row = table[width]
        if not isinstance(row, dict) or not row:
            return f"refused: width {label} has no prices"
        priced = {}
        for bs, ms in row.items():
            good = isinstance(ms, int | float) and not isinstance(ms, bool) and math.isfinite(ms) and ms > 0
            size = isinstance(bs, str) and bs.isascii() and bs.isdigit() and 1 <= int(bs) <= 4096
            if not (size and good):
                return f"refused: width {label} batch size {ascii(bs)[:20]}: {ascii(ms)[:20]} ms"
            priced[int(bs)] = float(ms)
        lo, hi = min(priced), max(priced)
        sizes |= {lo, hi}
        cells.append((label, f"{label}:{priced[lo]:.0f}" + (f"-{priced[hi]:.0f}" if hi != lo else "")))
    cells.sort(key=lambda c: (0, 0) if c[0] == "chain" else (1, int(c[0])))
    span = f"{min(sizes)}-{max(sizes)}" if len(sizes) > 1 else str(min(sizes))
    return f"{' '.join(c for _, c in cells)} ms (bs {span}, {doc['method']})"


def decoder_cells(probe: Any) -> DecoderCells:
    """The cells from the host's ``probe`` answer (``fleet_remote.last_probe``)."""
    if not isinstance(probe, dict):
        return DecoderCells()
    decoder = probe.get("decoder") if isinstance(probe.get("decoder"), dict) else {}
    return DecoderCells(_text(probe.get("setting")), _width_cell(decoder.get("width_state")),
                        _price_cell(decoder.get("prices")))  # fmt: skip
