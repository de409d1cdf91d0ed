"""round/width_choice.py and width_metrics.py: an adaptive server's width per round from its prices and each
width's own emitted tokens, counted on the device and read back without a host sync."""

from __future__ import annotations

import pytest
import torch

from ddtree_runtime.core.round_prices import PriceTable, RoundPrice
from ddtree_runtime.sglang_plugin.price_table import merge_tables
from ddtree_runtime.sglang_plugin.round.width_choice import WidthChoice

WARM = "ddtree-warmup-"


class Req:
    def __init__(self, rid: str) -> None:
        self.rid = rid


def _prices(widths=(4, 16), sizes=(1, 2, 4, 8)) -> PriceTable:
    # a round: 10 ms plus 0.5 ms per verify row and request (the wide tree costs more as the batch grows)
    prices = {(str(w), b): RoundPrice(0.010 + 0.0005 * (w + 1) * b, 0.002) for w in widths for b in sizes}
    return PriceTable(prices, "eager", 5)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _round(choice: WidthChoice, bs: int, tokens_by_width: dict[int, int], clock: Clock) -> int:
    budget, counted = choice.pick([Req(f"r{i}") for i in range(bs)])
    assert counted
    choice.count(budget, torch.full((bs,), tokens_by_width[budget], dtype=torch.int32))
    clock.now += 0.3
    return budget


def test_counts_reach_the_chooser_by_readback_and_it_picks_per_batch_size():
    clock = Clock()
    published = []
    choice = WidthChoice((4, 16), _prices(), torch.device("cpu"), warmup_prefix=WARM, clock=clock,
                         publish=published.append, explore_rows=8, revisit_every=0)  # fmt: skip
    picked = [_round(choice, 2, {4: 3, 16: 7}, clock) for _ in range(8)]
    assert picked == [4, 16] * 4  # exploration alternates the widths, round by round
    assert choice.tokens.tolist() == [4 * 2 * 3, 4 * 2 * 7]  # every round's tokens on its width
    assert choice.chooser.exploring  # the host has not seen 8 rows of each yet: the copies lag
    for _ in range(6):
        if choice.chooser.exploring:
            _round(choice, 2, {4: 3, 16: 7}, clock)  # a copy every 0.5 s, read a round later
    assert not choice.chooser.exploring and published
    assert choice.chooser.observed["4"][0] == pytest.approx(3.0)
    assert choice.chooser.observed["16"][0] == pytest.approx(7.0)
    # 7 tokens at 17 rows against 3 at 5: the wide tree pays at one request, not at eight
    table = choice.chooser.policy.table
    assert table[1] == "16" and table[8] == "4"
    assert choice.pick([Req("a")])[0] == 16 and choice.pick([Req(str(i)) for i in range(8)])[0] == 4


def test_warmup_rounds_take_the_width_their_ids_name_else_cycle_and_are_not_counted():
    from ddtree_runtime.sglang_plugin import warmup

    choice = WidthChoice((4, 16), _prices(), torch.device("cpu"), warmup_prefix=warmup.RID_PREFIX)
    named = [choice.pick([Req(f"{warmup.RID_PREFIX}{w}-8-0.0-{i}-00")]) for w in (16, 4) for i in range(3)]
    assert named == [(16, False)] * 3 + [(4, False)] * 3
    turns = [choice.pick([Req(f"{warmup.RID_PREFIX}x-1-0.0-{i}-00")]) for i in range(4)]  # one-width form
    assert sorted({b for b, _ in turns}) == [4, 16] and not any(c for _, c in turns)
    assert choice.chooser.rounds == 0 and choice.to_dict()["rounds"] == {"4": 0, "16": 0}


def test_the_warmup_runs_every_width_of_an_adaptive_server():
    from types import SimpleNamespace

    from ddtree_runtime.core.decoder_settings import DecoderSettings
    from ddtree_runtime.sglang_plugin.algorithm import RESOLVED_ATTR, PluginSettings
    from ddtree_runtime.sglang_plugin.warmup import warmup_widths

    record = SimpleNamespace(**{RESOLVED_ATTR: PluginSettings(DecoderSettings.resolve("auto", 16))})
    assert warmup_widths(record) == (15, 31)
    setattr(record, RESOLVED_ATTR, PluginSettings(DecoderSettings(16, 16)))
    assert warmup_widths(record) == (None,) and warmup_widths(None) == (None,)


def test_a_batch_larger_than_the_index_grows_it():
    clock = Clock()
    choice = WidthChoice((4, 16), _prices(), torch.device("cpu"), warmup_prefix=WARM, clock=clock)
    for bs in (3, 200):
        budget, _ = choice.pick([Req(str(i)) for i in range(bs)])
        choice.count(budget, torch.ones(bs, dtype=torch.int64))
    assert int(choice.tokens.sum()) == 203


def test_metrics_count_rounds_per_width_and_the_choice_per_batch_size():
    from prometheus_client import CollectorRegistry

    from ddtree_runtime.sglang_plugin.width_metrics import WidthMetrics

    registry = CollectorRegistry()
    metrics = WidthMetrics(registry)
    clock = Clock()
    choice = WidthChoice((4, 16), _prices(), torch.device("cpu"), warmup_prefix=WARM, clock=clock,
                         publish=metrics.publish, explore_rows=2, revisit_every=0)  # fmt: skip
    for _ in range(12):
        _round(choice, 1, {4: 2, 16: 6}, clock)
    value = registry.get_sample_value
    rounds = {w: value("sglang:ddtree_width_rounds_total", {"width": w}) for w in ("4", "16")}
    assert rounds["4"] >= 1 and rounds["16"] >= 1 and sum(rounds.values()) <= 12
    assert value("sglang:ddtree_width_tokens_per_round", {"width": "16"}) == pytest.approx(6.0)
    assert value("sglang:ddtree_width_chosen_budget", {"batch_size": "1"}) == 16.0


def test_merged_tables_keep_every_width_and_say_eager_where_any_was():
    a = PriceTable({("16", 1): RoundPrice(0.01, 0.002)}, "graphs", 5, 1.0)
    b = PriceTable({("4", 1): RoundPrice(0.02, 0.002)}, "eager", 5, 2.0)
    merged = merge_tables([a, b])
    assert set(merged.prices) == {("16", 1), ("4", 1)}
    assert merged.method == "eager" and merged.measure_s == 3.0
    assert merge_tables([a]) is a
    with pytest.raises(ValueError, match="no price table"):
        merge_tables([])
