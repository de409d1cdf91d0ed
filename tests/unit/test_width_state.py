"""An adaptive server as the host-side tools read it (issue 41): its widths in /server_info
(`speculative_ddtree_widths`, per scheduler `ddtree_widths`) and on /metrics (`sglang:ddtree_width_*`), the
setting shown one way (`auto(15,31)`), the live probe's expected budget and its record for fleet status, and
the canary comparing an adaptive shadow with a fixed live. Literal answers; no server, no process.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from ddtree_runtime.core.width_policy import WidthChooser
from ddtree_runtime.health import canary, sglang_client
from ddtree_runtime.health import counterfactual_counters as cf
from ddtree_runtime.health.probe_report import Report, format_report
from ddtree_runtime.health.probe_server_info import flag_mismatch, record_decoder
from ddtree_runtime.health.width_state import WidthStateError, parse_width_state, width_metrics

PRICES = {(w, b): 0.01 * (1 + b / 16) * (1.0 if w == "15" else 1.3)
          for w in ("15", "31") for b in (1, 2, 4, 8)}  # fmt: skip


def _chooser_state() -> dict[str, Any]:
    """What a real WidthChooser publishes after exploring (core/width_policy), through JSON."""
    chooser = WidthChooser(("15", "31"), PRICES, explore_rows=4)
    for _ in range(10):
        chooser.choose(2)
    chooser.observe({"15": 40.0, "31": 60.0}, {"15": 10, "31": 10})
    return json.loads(json.dumps(chooser.to_dict()))


STATE = {"widths": ["15", "31"], "exploring": False, "table": {"1": "15", "2": "15", "4": "31", "8": "31"},
         "tokens_per_round": {"15": 4.1, "31": 5.02}, "observed_rows": {"15": 300, "31": 260},
         "rounds": {"15": 120, "31": 80}}  # fmt: skip
INFO = {"speculative_algorithm": "DDTREE", "speculative_ddtree_budget": 31,
        "speculative_ddtree_widths": [15, 31], "speculative_dflash_block_size": 16,
        "internal_states": [{"ddtree_widths": STATE}]}  # fmt: skip


def test_a_choosers_published_state_reads_back_and_shows_compactly() -> None:
    state = parse_width_state(_chooser_state())
    assert state.widths == ("15", "31") and not state.exploring
    assert state.table_text() == "1-8:31"  # on these prices and means 31 pays at every size
    assert state.rounds_text() == "15:5 31:5" and state.tokens_per_round == {"15": 4.0, "31": 6.0}
    shown = parse_width_state(STATE)
    assert shown.table_text() == "1-2:15 4-8:31" and shown.to_dict() == STATE
    exploring = parse_width_state({**STATE, "exploring": True, "table": {}})
    assert exploring.table_text() == "exploring"
    single = parse_width_state({**STATE, "table": {"1": "15", "4": "31", "8": "15"}})
    assert single.table_text() == "1:15 4:31 8:15"


@pytest.mark.parametrize(
    ("change", "words"),
    [({"widths": ["15"]}, r"want a list of 2\.\.4 widths"), ({"widths": ["15", "15"]}, "names a width twice"),
     ({"widths": ["15", "x"]}, r"widths\[1\]"), ({"exploring": "no"}, "exploring is 'no'"),
     ({"table": {"0": "15"}}, "not a batch size"), ({"table": {"1": "16"}}, "width 16, not one of"),
     ({"tokens_per_round": {"15": float("nan")}}, r"tokens_per_round\[15\]"),
     ({"tokens_per_round": {"64": 1.0}}, "names width 64"), ({"rounds": {"15": -1}}, r"rounds\[15\] is -1"),
     ({"observed_rows": {"15": True}}, r"observed_rows\[15\] is True"), ({"rounds": []}, "rounds is"),
     ("not a dict", "not an object")],
)  # fmt: skip
def test_a_state_no_server_writes_is_refused_naming_the_field(change: Any, words: str) -> None:
    doc = {**STATE, **change} if isinstance(change, dict) else change
    with pytest.raises(WidthStateError, match=words):
        parse_width_state(doc)


def test_the_width_series_on_metrics() -> None:
    text = ("# TYPE sglang:ddtree_width_rounds_total counter\n"
            'sglang:ddtree_width_rounds_total{width="31"} 80\n'
            'sglang:ddtree_width_rounds_total{width="15"} 120\n'
            "# TYPE sglang:ddtree_width_tokens_per_round gauge\n"
            'sglang:ddtree_width_tokens_per_round{width="15"} 4.25\n'
            "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 3\n")  # fmt: skip
    assert width_metrics(text) == {"15": {"rounds": 120, "tokens_per_round": 4.25}, "31": {"rounds": 80}}
    assert list(width_metrics(text)) == ["15", "31"]  # narrowest first
    assert width_metrics("# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 3\n") == {}
    with pytest.raises(ValueError, match="width label"):
        width_metrics('sglang:ddtree_width_rounds_total{width="wide"} 1\n')


def test_the_server_info_reader_takes_the_widths_and_shows_the_setting_one_way() -> None:
    server = sglang_client.read_server_info(INFO)
    assert server.widths == (15, 31) and server.budget == 31
    assert sglang_client.setting_text(server) == "auto(15,31)"
    listed = sglang_client.read_server_info({**INFO, "speculative_ddtree_widths": [7, 31]})
    assert sglang_client.setting_text(listed) == "7,31"
    for bad in ([31, 15], [15], [15, 15, 31], [0, 31], ["15", 31], 31, [1, 2, 3, 4, 31]):
        assert sglang_client.read_server_info({**INFO, "speculative_ddtree_widths": bad}).widths == ()
    fixed = sglang_client.read_server_info({**INFO, "speculative_ddtree_budget": 16,
                                            "speculative_ddtree_widths": None})  # fmt: skip
    assert sglang_client.setting_text(fixed) == "16"
    dflash = sglang_client.read_server_info({"speculative_algorithm": "DFLASH",
                                             "speculative_dflash_block_size": 16})  # fmt: skip
    assert sglang_client.setting_text(dflash) == "chain"
    assert sglang_client.setting_text(sglang_client.read_server_info({})) is None
    state = sglang_client.server_width_state(INFO)
    assert state is not None and state.table_text() == "1-2:15 4-8:31"
    assert sglang_client.server_width_state({"internal_states": [{}, {"ddtree_widths": STATE}]}) == state
    assert sglang_client.server_width_state({"internal_states": [{}]}) is None
    with pytest.raises(sglang_client.BadAnswer, match=r"internal_states\[0\]\.ddtree_widths\.widths"):
        sglang_client.server_width_state({"internal_states": [{"ddtree_widths": {**STATE, "widths": 5}}]})


def test_tunes_reader_says_an_adaptive_server_runs_no_one_setting() -> None:
    said = cf.server_decoder(INFO)
    assert said.label is None and said.horizon == 15
    assert said.adaptive is not None and said.adaptive.widths == (15, 31)
    assert "adaptive widths auto(15,31)" in said.why
    assert cf.server_decoder({**INFO, "speculative_ddtree_widths": None}).label == "31"


@pytest.mark.parametrize(
    ("want", "info", "wrong"),
    [("auto", INFO, None), ("15,31", INFO, None), ("31,15", INFO, None),
     ("16", INFO, "speculative_ddtree_budget=auto(15,31) (want 16)"),
     ("31", INFO, "speculative_ddtree_budget=auto(15,31) (want 31)"),
     ("auto", {**INFO, "speculative_ddtree_widths": None}, "speculative_ddtree_budget=31 (want auto(15,31))"),
     ("16", {**INFO, "speculative_ddtree_budget": 16, "speculative_ddtree_widths": None}, None),
     ("auto2", INFO, "(want auto2: --speculative-ddtree-budget takes a whole number"),
     ("16", {"speculative_ddtree_budget": 16}, None),  # no block: compared as text, as before
     ("auto", {"speculative_ddtree_budget": 31}, "speculative_ddtree_budget=31 (want auto)")],
)  # fmt: skip
def test_the_live_probe_checks_the_profiles_budget_by_the_rule(want: str, info: dict,
                                                               wrong: str | None) -> None:  # fmt: skip
    server = sglang_client.read_server_info(info)
    found = flag_mismatch("speculative_ddtree_budget", want, info, server)
    assert (found is None) == (wrong is None) and (wrong is None or wrong in found), found
    assert flag_mismatch("context_length", "8192", {"context_length": 8192}, server) is None
    assert flag_mismatch("port", "30000", {"port": 30001}, server) == "port=30001 (want 30000)"


def test_the_live_probe_records_what_fleet_status_shows() -> None:
    prices = {"unit": "seconds", "method": "graphs", "repeats": 5,
              "entries": [{"width": w, "batch_size": b, "verify_s": 0.02, "rest_s": 0.002 * b}
                          for w in ("15", "31") for b in (1, 8)]}  # fmt: skip
    info = {**INFO, "internal_states": [{"ddtree_widths": STATE, "ddtree_prices": prices}]}
    report = Report("live")
    record_decoder(report, sglang_client.read_server_info(info))
    assert report.figures["setting"] == "auto(15,31)"
    decoder = report.figures["decoder"]
    assert decoder["widths"] == [15, 31] and decoder["width_state"] == STATE and "errors" not in decoder
    assert decoder["prices"] == {"method": "graphs", "round_ms": {"15": {"1": 22.0, "8": 36.0},
                                                                  "31": {"1": 22.0, "8": 36.0}}}  # fmt: skip
    assert "setting=auto(15,31)" in format_report(report) and "width_state" not in format_report(report)
    json.dumps(report.to_dict(), allow_nan=False)
    # A malformed state or table is named, never a failed probe: it does not gate a deploy.
    broken = {**INFO, "internal_states": [{"ddtree_widths": {"widths": 3}, "ddtree_prices": {"unit": "ms"}}]}
    report = Report("live")
    record_decoder(report, sglang_client.read_server_info(broken))
    assert report.ok and report.figures["decoder"]["width_state"] is None
    assert len(report.figures["decoder"]["errors"]) == 2


def _fake_servers(monkeypatch: pytest.MonkeyPatch, infos: dict[str, dict]) -> None:
    """Two servers that answer the same greedy tokens; each its own /server_info."""

    def generate(base: str, payload: dict, *, timeout: float) -> tuple[int, bytes]:
        ids = [5, 6, 7, 8, 9, 10, 11, 12]
        return 200, json.dumps({"text": "x" * len(ids), "output_ids": ids,
                                "meta_info": {"completion_tokens": len(ids), "spec_verify_ct": 3}}).encode()

    monkeypatch.setattr(sglang_client, "health_generate", lambda base, *, timeout: 200)
    monkeypatch.setattr(sglang_client, "server_info", lambda base, *, timeout: (200, infos[base]))
    monkeypatch.setattr(sglang_client, "generate", generate)


def test_the_canary_compares_an_adaptive_shadow_with_a_fixed_live_and_says_both(monkeypatch) -> None:
    live = {**INFO, "speculative_ddtree_budget": 16, "speculative_ddtree_widths": None,
            "ddtree_instance_id": "live-1", "internal_states": []}  # fmt: skip
    shadow = {**INFO, "ddtree_instance_id": "shadow-1"}
    _fake_servers(monkeypatch, {"http://127.0.0.1:30000": live, "http://127.0.0.1:30001": shadow})
    report = canary.compare("http://127.0.0.1:30000", "http://127.0.0.1:30001", prompts=["a", "b"], rounds=1,
                            ready_timeout=5, request_timeout=5)  # fmt: skip
    assert report.verdict == "promote", report.reason
    assert (report.live["setting"], report.shadow["setting"]) == ("16", "auto(15,31)")
    row = next(line for line in report.table() if line.strip().startswith("setting"))
    assert row.split()[1:3] == ["16", "auto(15,31)"] and "differ" in row
    accept = next(c for c in report.checks if c.name == "accept_length")
    assert "(shadow runs auto(15,31), live 16)" in accept.detail
    # Like with like: nothing to flag.
    same = {**shadow, "ddtree_instance_id": "live-2"}
    _fake_servers(monkeypatch, {"http://127.0.0.1:30000": same, "http://127.0.0.1:30001": shadow})
    report = canary.compare("http://127.0.0.1:30000", "http://127.0.0.1:30001", prompts=["a"], rounds=1,
                            ready_timeout=5, request_timeout=5)  # fmt: skip
    row = next(line for line in report.table() if line.strip().startswith("setting"))
    assert "differ" not in row and "shadow runs" not in next(c for c in report.checks
                                                             if c.name == "accept_length").detail
