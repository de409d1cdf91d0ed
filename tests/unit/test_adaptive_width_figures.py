"""scripts/bench/adaptive_width_figures.py: issue 41's cells from literal bench lines (which width the
adaptive server verified at each concurrency, against the fastest fixed budget and DFLASH)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts/bench/adaptive_width_figures.py"
spec = importlib.util.spec_from_file_location("adaptive_width_figures", SCRIPT)
figures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(figures)


def _summary(server: str, level: int, rate: float) -> dict:
    return {"case": "bench_summary", "pair": "hybrid", "server": server, "concurrency": level,
            "output_tokens_per_s": rate}  # fmt: skip


LINES = [
    _summary("hybrid-dflash", 1, 1000.0), _summary("hybrid-ddtree-b15", 1, 1100.0),
    _summary("hybrid-ddtree-b31", 1, 1200.0), _summary("hybrid-ddtree-bauto", 1, 1190.0),
    _summary("hybrid-dflash", 16, 7000.0), _summary("hybrid-ddtree-b15", 16, 7500.0),
    _summary("hybrid-ddtree-b31", 16, 6000.0), _summary("hybrid-ddtree-bauto", 16, 7200.0),
    {"case": "bench_widths", "pair": "hybrid", "server": "hybrid-ddtree-bauto", "exploring": False,
     "table": {"1": "31", "2": "31", "8": "15", "16": "15"}},
]  # fmt: skip


def test_each_cell_compares_auto_with_the_fastest_fixed_budget_and_dflash(tmp_path):
    rows = figures.cells(LINES)
    by_level = {r["concurrency"]: r for r in rows}
    assert by_level[1]["best_fixed"] == "31" and by_level[1]["vs_best_fixed"] == round(1190 / 1200, 3)
    assert by_level[1]["vs_dflash"] == 1.19 and by_level[1]["chosen"] == "31"
    assert by_level[16]["best_fixed"] == "15" and by_level[16]["chosen"] == "15"
    assert by_level[16]["vs_best_fixed"] == 0.96
    text = "\n".join(figures.table(rows))
    # 1: within 2 % of 31 and above DFLASH; 16: 4 % under budget 15; both chose the fastest fixed budget
    assert "auto >= best fixed - 2 % and >= DFLASH: 1 of 2 cells" in text
    assert "chose the fastest fixed budget: 2 of 2 cells" in text
    path = tmp_path / "lines.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in LINES) + "\nnot json\n")
    assert figures.main([str(path), "--json"]) == 0


def test_the_chosen_width_is_the_bucket_that_holds_the_concurrency():
    table = {"1": "31", "4": "31", "8": "15"}
    got = [figures.chosen_width(table, c) for c in (1, 2, 4, 5, 8, 64)]
    assert got == ["31", "31", "31", "15", "15", "15"]
    assert figures.chosen_width({}, 4) is None


def test_the_changing_load_says_whether_auto_is_ahead_of_every_fixed_budget_and_dflash():
    def phases(server: str, rate: float) -> dict:
        return {"case": "bench_phases", "pair": "hybrid", "server": server, "phases": [1, 16, 4, 1],
                "output_tokens_per_s": rate}  # fmt: skip

    lines = [phases("hybrid-dflash", 2000.0), phases("hybrid-ddtree-b15", 2300.0),
             phases("hybrid-ddtree-b31", 2200.0), phases("hybrid-ddtree-bauto", 2400.0)]  # fmt: skip
    text = "\n".join(figures.phases_table(lines))
    assert "hybrid, concurrency 1 -> 16 -> 4 -> 1 in one run:" in text
    assert "| hybrid-ddtree-bauto | 2400.0 | 1.2 |" in text
    assert "hybrid-ddtree-bauto: ahead of every fixed budget: True; ahead of DFLASH: True" in text
    lines[1]["output_tokens_per_s"] = 2500.0
    assert "ahead of every fixed budget: False" in "\n".join(figures.phases_table(lines))
