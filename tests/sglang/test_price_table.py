"""The start-up price table in the SGLang plugin on CPU (docs/price-table.md): the switch through SGLang's own
parser, the worker measuring once and keeping the table (``DDTreeWorker._measure_prices``), the round's
stages as the table times them on SGLang's real pools (``RoundBucket.replay_stages``: at start-up only the
dummy slot moves), and the table on ``/server_info`` (internal states) and ``/metrics`` (real prometheus
gauges). The whole start-up on the real server: tests/sglang/test_real_server.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from ddtree_runtime.core.decoder_settings import DecoderSettings
from ddtree_runtime.core.round_prices import PriceTable, RoundPrice
from tests.sglang.conftest import ddtree_argv, resolve

pytestmark = pytest.mark.sglang

FLAG = "--speculative-ddtree-price-table"


@pytest.mark.parametrize(("extra", "on"), [((), False), ((FLAG,), True), ((FLAG, "false"), False),
                                           ((FLAG, "on"), True), ((FLAG, "0"), False)])  # fmt: skip
def test_the_switch_is_off_by_default_and_reaches_the_worker_settings(sglang_plugins, pair, extra, on):
    record, _ = resolve(ddtree_argv(*pair, *extra))
    assert record._ddtree_resolved.price_table is on


def test_a_bad_switch_value_is_refused_by_the_parser_with_the_words_it_takes(sglang_plugins, pair, capsys):
    with pytest.raises(SystemExit):
        resolve(ddtree_argv(*pair, FLAG, "maybe"))
    assert f"{FLAG} is a switch: alone, or one of true, 1, yes, on, false, 0, no, off; got 'maybe'" in (
        capsys.readouterr().err
    )


def _worker(*, budget: int | str = 7, block: int = 4, cap: int | None = None, on: bool = True):
    from ddtree_runtime.sglang_plugin.algorithm import PluginSettings
    from ddtree_runtime.sglang_plugin.ddtree_worker import DDTreeWorker

    worker = object.__new__(DDTreeWorker)  # no GPU, no runners: the stages are stubbed
    worker.ddtree_settings = PluginSettings(DecoderSettings.resolve(budget, block, cap), price_table=on)
    worker._ddtree_metrics = None
    worker._round_graphs = "the widest width's graphs"
    worker._round_config = lambda budget=None: ("cfg", budget)
    return worker


def test_an_adaptive_server_prices_every_width_at_the_widest_ones_sizes(monkeypatch):
    calls: list[int] = []
    stages = _stubbed_stages(monkeypatch, calls)
    worker = _worker(budget="3,7")
    table = worker._measure_prices()
    assert table.widths() == ["3", "7"] and table.batch_sizes("3") == table.batch_sizes("7") == [1, 2]
    # the widest first with its graphs; the narrower at the widest's sizes, verify rows 4 (SGLang's dummy
    # forward sized by the plugin's hook), no graphs (its verify and round run eagerly)
    assert stages.asked == [(("cfg", 7), None, None), (("cfg", 3), [1, 2], 4)]
    assert worker._graphs_for(7) == "the widest width's graphs" and worker._graphs_for(3) is None
    worker._ddtree_prices = table
    worker._target_worker = SimpleNamespace(model_runner=SimpleNamespace(device="cpu"))
    worker._ddtree_width_choice = choice = worker._width_choice()
    assert choice.budgets == (3, 7) and choice.chooser.exploring
    assert worker.ddtree_widths()["widths"] == ["3", "7"]
    worker._ddtree_prices = None
    assert worker._width_choice() is None  # no prices: every round verifies the widest width
    assert _worker()._width_choice() is None  # a fixed budget chooses nothing


def _stubbed_stages(monkeypatch, calls: list[int], fail: bool = False):
    from ddtree_runtime.sglang_plugin import price_stages

    def stages(worker, cfg, graphs, *, sizes=None, rows=None):
        if fail:
            raise LookupError("no captured graph at batch size 3")
        asked.append((cfg, sizes, rows))

        def at(bs: int):
            return (lambda: calls.append(bs)), (lambda: calls.append(-bs))

        return sizes or [1, 2], at, "eager", lambda: None

    asked: list = []
    stages.asked = asked  # type: ignore[attr-defined]

    monkeypatch.setattr(price_stages, "worker_stages", stages)
    return stages


def test_the_worker_measures_each_batch_size_once_at_start_and_keeps_the_table(monkeypatch):
    calls: list[int] = []
    _stubbed_stages(monkeypatch, calls)
    worker = _worker()
    worker._ddtree_prices = worker._measure_prices()
    table = worker.ddtree_prices()
    assert [(e["width"], e["batch_size"]) for e in table["entries"]] == [("7", 1), ("7", 2)]
    assert table["method"] == "eager" and table["repeats"] == 5
    # One untimed and five timed runs of each stage at each size, and nothing more.
    assert sorted(calls) == sorted([1] * 6 + [-1] * 6 + [2] * 6 + [-2] * 6)
    # A capped tree is priced under its budget (its round has the same shape).
    assert _worker(cap=2)._measure_prices().widths() == ["7"]


def test_no_table_for_the_chain_or_when_it_cannot_be_measured_and_the_server_serves_on(monkeypatch, caplog):
    calls: list[int] = []
    _stubbed_stages(monkeypatch, calls)
    with caplog.at_level(logging.WARNING):
        assert _worker(budget=3, block=4, cap=1)._measure_prices() is None  # the chain: DFlash's round
    assert "no price table for the chain" in caplog.text and not calls
    _stubbed_stages(monkeypatch, calls, fail=True)
    with caplog.at_level(logging.WARNING):
        assert _worker()._measure_prices() is None
    assert "no price table (LookupError: no captured graph at batch size 3)" in caplog.text
    worker = _worker(on=False)
    assert worker.ddtree_prices() is None  # never measured: nothing on /server_info


def test_the_round_stages_the_table_times_move_only_the_dummy_slot_at_start_up():
    from tests.sglang.test_round_graphs import PROMPTS, _graphs
    from tests.sglang.test_tree_decode import _setup

    target, _models, *_rest, cfg, kv = _setup(PROMPTS[:2])
    graphs = _graphs(cfg, kv, sizes=[1, 4], vocab=target.vocab)
    before = kv.get_key_buffer(0).clone()
    kv.get_key_buffer(0)[0].fill_(7.0)  # the dummy slot: whatever it holds is nobody's
    for bucket in graphs.buckets.values():
        assert bucket._accept_out is None
        bucket.replay_stages()
        assert bucket._plan_out is not None and bucket._accept_out is not None
        lens = bucket._accept_out.kv.new_seq_lens  # prefix 0 + what the dummy tree emitted
        assert lens.shape == (bucket.size,) and bool(((lens >= 1) & (lens <= cfg.block_size)).all())
    changed = (kv.get_key_buffer(0) != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(changed) <= {0}


TABLE = PriceTable({("16", 1): RoundPrice(0.02, 0.004), ("16", 4): RoundPrice(0.03, 0.006)}, "graphs", 5)


def test_the_table_is_in_the_schedulers_internal_state_and_on_metrics():
    from prometheus_client import CollectorRegistry, generate_latest

    from ddtree_runtime.sglang_plugin.price_metrics import PriceMetrics
    from ddtree_runtime.sglang_plugin.server_info import add_to_internal_state

    worker = SimpleNamespace(ddtree_handshake=lambda: {"status": "ok"}, ddtree_prices=TABLE.to_dict)
    state: dict = {}
    add_to_internal_state(None, SimpleNamespace(scheduler=SimpleNamespace(draft_worker=worker)), state)
    assert state == {"ddtree_handshake": {"status": "ok"}, "ddtree_prices": TABLE.to_dict()}
    off = SimpleNamespace(ddtree_handshake=lambda: {"status": "ok"}, ddtree_prices=lambda: None)
    state = {}
    add_to_internal_state(None, SimpleNamespace(scheduler=SimpleNamespace(draft_worker=off)), state)
    assert "ddtree_prices" not in state

    registry = CollectorRegistry()
    PriceMetrics(registry).publish(TABLE)
    text = generate_latest(registry).decode()
    assert 'sglang:ddtree_price_verify_seconds{batch_size="4",width="16"} 0.03' in text
    assert 'sglang:ddtree_price_rest_seconds{batch_size="1",width="16"} 0.004' in text
    assert 'sglang:ddtree_price_round_seconds{batch_size="1",width="16"} 0.024' in text


def test_measuring_never_runs_inside_a_served_round():
    """The only caller of the timer is the start-up path: a decode round that reached it would time
    (synchronise) under traffic, which the overlap contract forbids (tests/sglang/test_tree_round_sync.py)."""
    import ast
    import inspect

    from ddtree_runtime.sglang_plugin import ddtree_worker

    tree = ast.parse(inspect.getsource(ddtree_worker))
    callers = {
        fn.name
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef)
        for node in ast.walk(fn)
        if isinstance(node, ast.Attribute) and node.attr == "_measure_prices"
    }
    assert callers == {"init_cuda_graphs"}
