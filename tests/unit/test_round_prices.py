"""A server's start-up round prices (docs/price-table.md): the table type and its one parser
(``core/round_prices``), the reader of ``/server_info`` (``health/sglang_client.server_prices``), the timing
arithmetic the plugin runs at start-up (``sglang_plugin/price_table``, stdlib and a fake clock here), and
``ddtree tune`` pricing rounds with a server's own table and saying so."""

from __future__ import annotations

import json

import pytest

from ddtree_runtime.cli import main
from ddtree_runtime.core.round_prices import (
    METRIC_PREFIX,
    PriceTable,
    PriceTableError,
    RoundPrice,
    metric_samples,
    parse_price_table,
    width_label,
)
from ddtree_runtime.health.sglang_client import BadAnswer, server_prices
from ddtree_runtime.planner import tune
from ddtree_runtime.sglang_plugin.price_table import measure_prices, median_seconds
from tests.unit.test_tune import SNAP, _Fake, _metrics_text, fake_server  # noqa: F401 (a fixture)

TABLE = PriceTable(
    {("16", 1): RoundPrice(0.020, 0.004), ("16", 4): RoundPrice(0.030, 0.006)}, "graphs", 5, 1.5
)


def test_the_table_round_trips_through_its_wire_form_and_prices_rounds_in_ms() -> None:
    doc = json.loads(json.dumps(TABLE.to_dict()))
    assert doc["unit"] == "seconds" and [e["batch_size"] for e in doc["entries"]] == [1, 4]
    back = parse_price_table(doc)
    assert back == TABLE
    assert back.widths() == ["16"] and back.batch_sizes("16") == [1, 4]
    assert back.round_ms() == {"16": {1: pytest.approx(24.0), 4: pytest.approx(36.0)}}
    assert width_label(16, chain=False) == "16" and width_label(15, chain=True) == "chain"
    samples = metric_samples(TABLE)
    assert samples[(METRIC_PREFIX + "verify_seconds", "16", 4)] == 0.030
    assert samples[(METRIC_PREFIX + "rest_seconds", "16", 1)] == 0.004
    assert samples[(METRIC_PREFIX + "round_seconds", "16", 1)] == pytest.approx(0.024)
    assert len(samples) == 3 * len(TABLE.prices)


def _entry(**change: object) -> dict:
    return {**{"width": "16", "batch_size": 1, "verify_s": 0.01, "rest_s": 0.002}, **change}


def _doc(*entries: dict, **change: object) -> dict:
    return {**{"unit": "seconds", "method": "eager", "repeats": 5, "entries": list(entries) or [_entry()]},
            **change}  # fmt: skip


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "ddtree_prices is list, not an object"),
        (_doc(unit="ms"), "ddtree_prices.unit is 'ms', not 'seconds'"),
        (_doc(method="guess"), "method is 'guess', not one of graphs, eager"),
        (_doc(repeats=0), r"repeats is 0, not a whole number in 1\.\.1000"),
        (_doc(repeats=True), "repeats is True"),
        (_doc(entries=[]), r"entries is 0: want a list of 1\.\.4096"),
        (_doc(entries="x"), "entries is str"),
        (_doc(_entry(width="16x")), r"entries\[0\]\.width '16x' is neither 'chain' nor a decimal budget"),
        (_doc(_entry(width=16)), r"entries\[0\]\.width 16 is neither"),
        (_doc(_entry(batch_size=0)), r"entries\[0\]\.batch_size is 0"),
        (_doc(_entry(), _entry(verify_s=0.5)), r"entries\[1\]: width 16 at batch size 1 is priced twice"),
        (_doc(_entry(verify_s=float("nan"))), r"verify_s is nan, not a finite number of seconds"),
        (_doc(_entry(rest_s=-0.1)), r"rest_s is -0\.1: a price is in \(0, 3600\] seconds"),
        (_doc(_entry(rest_s="0.1")), r"rest_s is '0\.1', not a finite number"),
        (_doc(measure_s=-1), r"measure_s is -1"),
    ],
)
def test_a_table_no_server_publishes_is_refused_naming_the_field(doc: object, message: str) -> None:
    with pytest.raises(PriceTableError, match=message):
        parse_price_table(doc)


def test_the_server_info_reader_finds_the_table_in_the_schedulers_states_or_says_what_is_wrong() -> None:
    assert server_prices({"internal_states": [{"avg_spec_accept_length": 2.0}]}) is None
    assert server_prices({}) is None and server_prices([]) is None
    info = {"internal_states": [{"x": 1}, {"ddtree_prices": TABLE.to_dict()}]}
    assert server_prices(info) == TABLE
    with pytest.raises(BadAnswer, match=r"internal_states\[0\]\.ddtree_prices\.unit is None"):
        server_prices({"internal_states": [{"ddtree_prices": {"entries": []}}]})
    with pytest.raises(BadAnswer, match="internal_states is 'x', not a list"):
        server_prices({"internal_states": "x"})


class _Clock:
    """A clock each run advances by the next duration of a script (the timer's arithmetic, no sleeping)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def run(self, durations: list[float]):
        it = iter(durations)

        def run() -> None:
            self.now += next(it)

        return run


def test_each_price_is_the_median_of_synchronised_runs_after_an_untimed_one() -> None:
    clock = _Clock()
    syncs: list[float] = []
    # The first run (first-use compiles) is not counted; of the five timed, the median.
    run = clock.run([9.0, 0.5, 0.1, 0.9, 0.2, 0.4])  # the mean of the timed five would be 0.42
    median = median_seconds(run, repeats=5, sync=lambda: syncs.append(clock.now), clock=clock)
    assert median == pytest.approx(0.4)
    assert len(syncs) == 10  # before and after each timed run
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        median_seconds(run, repeats=0, sync=lambda: None)


def test_the_table_has_one_price_per_batch_size_of_the_width() -> None:
    clock = _Clock()
    runs = {bs: (clock.run([1.0] + [0.01 * bs] * 3), clock.run([1.0] + [0.002 * bs] * 3)) for bs in (1, 2, 4)}
    table = measure_prices("16", [4, 1, 2, 2], runs.__getitem__, method="eager", sync=lambda: None,
                           repeats=3, clock=clock)  # fmt: skip
    assert sorted(table.prices) == [("16", 1), ("16", 2), ("16", 4)]
    assert table.prices[("16", 4)] == RoundPrice(pytest.approx(0.04), pytest.approx(0.008))
    assert (table.method, table.repeats) == ("eager", 3)
    assert table.measure_s == pytest.approx(3 * 2 * 1.0 + 3 * (0.01 + 0.002) * 7)


def test_tune_prices_the_running_setting_from_the_servers_table_and_scales_the_figures_for_the_rest() -> None:
    server = {"16": {1: 30.0, 4: 60.0}}
    ms, source = tune.priced_ms("16", 2, server=server, anchor="16")
    assert (ms, source) == (pytest.approx(40.0), tune.COST_SERVER)
    ms, source = tune.priced_ms("chain", 1, server=server, anchor="16")
    assert source == tune.COST_SERVER_SCALED
    assert ms == pytest.approx(tune.round_ms("chain", 1) * 30.0 / tune.round_ms("16", 1))
    # No price for what runs: the figures, as without a table.
    figures = (tune.round_ms("chain", 1), tune.COST_FIGURES)
    assert tune.priced_ms("chain", 1, server=server, anchor="8") == figures
    # An operator's table wins over everything.
    own = tune.priced_ms("16", 1, table={"16": {1: 5.0}}, server=server, anchor="16")
    assert own == (5.0, tune.COST_TABLE)


def test_the_verb_uses_the_servers_own_table_and_says_so(fake_server: str, capsys) -> None:  # noqa: F811
    _Fake.metrics = _metrics_text(SNAP)
    info = {"speculative_algorithm": "DDTREE", "speculative_ddtree_budget": 15,
            "speculative_ddtree_topk_cap": 1, "speculative_dflash_block_size": 16}  # fmt: skip
    chain_table = PriceTable({("chain", 1): RoundPrice(0.5, 0.5)}, "eager", 5)
    _Fake.info = {**info, "internal_states": [{"ddtree_prices": chain_table.to_dict()}]}
    assert main(["tune", "--url", fake_server, "--concurrency", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["setting"]: r for r in out["table"]}
    assert rows["chain"]["round_ms"] == pytest.approx(1000.0) and rows["chain"]["cost_source"] == "server"
    assert rows["16"]["cost_source"] == "server-scaled"
    scaled = tune.round_ms("16", 1) * 1000.0 / tune.round_ms("chain", 1)
    assert rows["16"]["round_ms"] == pytest.approx(scaled)
    assert out["cost_model"].startswith("the server's own price table (eager, chain at batch sizes 1)")
    assert out["server_prices"] == chain_table.to_dict()
    assert main(["tune", "--url", fake_server, "--concurrency", "1"]) == 0
    assert "[cost: server]" in capsys.readouterr().out
    # Without a table: the figures, and the output says that.
    _Fake.info = info
    assert main(["tune", "--url", fake_server, "--concurrency", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cost_model"] == "H200 production-shape figures" and out["server_prices"] is None
    assert {r["cost_source"] for r in out["table"]} == {"figures"}
    # A malformed table is bad input (exit 2), named.
    _Fake.info = {**info, "internal_states": [{"ddtree_prices": {"unit": "ms"}}]}
    assert main(["tune", "--url", fake_server, "--concurrency", "1"]) == 2
    assert "ddtree_prices.unit is 'ms'" in capsys.readouterr().err
