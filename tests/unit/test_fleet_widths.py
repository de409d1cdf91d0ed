"""`ddtree fleet status` shows what each server decodes with (issue 41): the setting (`16`, `auto(15,31)`), an
adaptive server's width per batch size and rounds per width, and its start-up round prices, from the host's
last live probe report (health/probe_server_info.record_decoder), checked on the controller. The host script
runs in-process here with systemd's and nvidia-smi's answers left out: no process, no SSH.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree_runtime.ops import fleet_remote, fleet_status, fleet_table
from ddtree_runtime.ops.fleet_decoder import decoder_cells

STATE = {"widths": ["15", "31"], "exploring": False, "table": {"1": "15", "2": "15", "4": "31", "8": "31"},
         "tokens_per_round": {"15": 4.1, "31": 5.02}, "observed_rows": {"15": 300, "31": 260},
         "rounds": {"15": 1200, "31": 340}}  # fmt: skip
PRICES = {"method": "graphs", "round_ms": {"31": {"1": 26.61, "8": 87.2}, "15": {"1": 22.1, "8": 61.04}}}
ADAPTIVE = {"setting": "auto(15,31)", "budget": 31, "widths": [15, 31], "width_state": STATE,
            "prices": PRICES}


def _facts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, figures: dict[str, dict]) -> dict:
    """What the host script answers when each unit's last probe report holds ``figures``."""
    root = tmp_path / "ddtree"
    (root / "probe").mkdir(parents=True)
    for unit, figs in figures.items():
        (root / "probe" / f"{unit}.json").write_text(json.dumps(
            {"probe": "live", "ok": True, "time": 1.0, "figures": {"accept_length": 3.2, **figs}}))
    monkeypatch.setattr(fleet_remote, "STATE_ROOT", root)
    monkeypatch.setattr(fleet_remote, "_run", lambda cmd: None)  # no systemctl here
    monkeypatch.setattr(fleet_remote.shutil, "which", lambda name: None)  # nor nvidia-smi
    fleet_remote.main(list(figures))
    return json.loads(capsys.readouterr().out)


def test_an_adaptive_live_and_a_fixed_shadow_side_by_side(tmp_path: Path, monkeypatch, capsys) -> None:
    fixed = {"setting": "16", "decoder": {"setting": "16", "budget": 16, "widths": [], "width_state": None,
                                          "prices": None}}  # fmt: skip
    facts = _facts(tmp_path, monkeypatch, capsys, {
        "sglang-qwen": {"setting": "auto(15,31)", "decoder": ADAPTIVE, "answers": ["long"]},
        "sglang-qwen-shadow": fixed})  # fmt: skip
    assert "answers" not in facts["units"]["sglang-qwen"]["probe"]  # only what the table needs crosses
    live, shadow = fleet_status.rows_from_facts("ct129", facts, ["sglang-qwen", "sglang-qwen-shadow"])
    assert live.setting == "auto(15,31)" and shadow.setting == "16"
    assert live.widths == "1-2:15 4-8:31; rounds 15:1200 31:340" and shadow.widths is None
    assert live.prices == "15:22-61 31:27-87 ms (bs 1-8, graphs)" and shadow.prices is None
    header, live_line, shadow_line = fleet_table.format_table([live, shadow], now=2.0).splitlines()
    columns = header.split("  ")
    for title in ("DECODER", "WIDTHS", "ROUND MS"):
        assert title in [c.strip() for c in columns if c.strip()]
    for cell in ("auto(15,31)", "1-2:15 4-8:31; rounds 15:1200 31:340",
                 "15:22-61 31:27-87 ms (bs 1-8, graphs)"):
        assert cell in live_line
    at = header.index("DECODER")
    assert live_line[at:].startswith("auto(15,31)") and shadow_line[at:].startswith("16 ")
    assert json.loads(json.dumps(live.to_dict()))["widths"] == live.widths  # --json carries the cells


def test_a_probe_report_from_before_the_widths_shows_dashes(tmp_path: Path, monkeypatch, capsys) -> None:
    facts = _facts(tmp_path, monkeypatch, capsys, {"sglang-qwen": {}})
    (row,) = fleet_status.rows_from_facts("ct129", facts, ["sglang-qwen"])
    assert (row.setting, row.widths, row.prices) == (None, None, None)
    header, line = fleet_table.format_table([row], now=2.0).splitlines()
    assert line[header.index("DECODER"):].startswith("-")


@pytest.mark.parametrize(
    ("decoder", "widths", "prices"),
    [({"width_state": {**STATE, "exploring": True, "table": {}}}, "exploring; rounds 15:1200 31:340", None),
     ({"width_state": {**STATE, "widths": ["15"]}}, "refused: decoder.width_state.widths is", None),
     ({"prices": {"method": "eager", "round_ms": {"16": {"4": 40.0}}}}, None, "16:40 ms (bs 4, eager)"),
     ({"prices": {"method": "graphs", "round_ms": {"16": {"1": -1}}}}, None,
      "refused: width 16 batch size '1': -1 ms"),
     ({"prices": {"method": "guess", "round_ms": {}}}, None, "refused: not a price table"),
     ({"prices": {"method": "graphs", "round_ms": {"x": {"1": 2.0}}}}, None, "refused: a priced width 'x'"),
     ("not an object", None, None)],
)  # fmt: skip
def test_a_hosts_answer_is_checked_before_it_is_shown(decoder: object, widths: str | None,
                                                      prices: str | None) -> None:  # fmt: skip
    cells = decoder_cells({"setting": "auto(15,31)\n", "decoder": decoder})
    assert cells.setting is None  # not one printable line: not shown
    assert (cells.widths is None) == (widths is None) and (widths is None or cells.widths.startswith(widths))
    assert (cells.prices is None) == (prices is None) and (prices is None or cells.prices.startswith(prices))
    assert decoder_cells(None).to_dict() == {"setting": None, "widths": None, "prices": None}
