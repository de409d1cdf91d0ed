"""core/width_policy.py: the width that pays at each batch size, from expected tokens per round over
the price of a round, with a prior until rounds are scored and a margin against flapping."""

from __future__ import annotations

import itertools
import random

import pytest

from ddtree_runtime.core.width_policy import WidthPolicy, WidthPolicyError, best_width, blended_tokens

SIZES = (1, 2, 4, 8, 16)


def _prices(per_row_ms: dict[str, float], rows: dict[str, int]) -> dict[tuple[str, int], float]:
    """A round: a fixed 20 ms plus, per request, its verify rows at a width-specific cost: nearly free
    at one request, dominant at sixteen (the 27B shape's memory-bound to compute-bound move)."""
    return {(w, b): 0.020 + b * rows[w] * per_row_ms[w] * 1e-3 for w in rows for b in SIZES}


def test_the_wider_tree_wins_alone_and_the_narrower_at_sixteen():
    prices = _prices({"16": 0.02, "32": 0.02}, {"16": 17, "32": 33})
    policy = WidthPolicy(("16", "32"), {"16": 5.0, "32": 5.6}, prices)
    assert policy.table[1] == "32"
    assert policy.table[16] == "16"
    # each choice is the brute-force best
    for size in SIZES:
        rate = {w: policy.priors[w] / prices[(w, size)] for w in ("16", "32")}
        assert policy.table[size] == max(rate, key=rate.get)


def test_best_width_is_the_argmax_of_tokens_per_second_on_random_tables():
    rng = random.Random(4)
    for _ in range(200):
        widths = [str(w) for w in rng.sample([8, 15, 16, 31, 32, 63], rng.randint(1, 4))]
        tokens = {w: rng.uniform(1, 8) for w in widths}
        cost = {w: rng.uniform(0.005, 0.05) for w in widths if rng.random() < 0.8} or {widths[0]: 0.01}
        got = best_width(tokens, cost)
        assert tokens[got] / cost[got] == max(tokens[w] / cost[w] for w in cost)


def test_ties_go_to_the_first_width_given():
    assert best_width({"16": 4.0, "32": 8.0}, {"16": 1.0, "32": 2.0}) == "16"
    assert best_width({"32": 8.0, "16": 4.0}, {"16": 1.0, "32": 2.0}) == "32"


def test_the_prior_counts_as_its_rounds_and_fades_under_scored_rounds():
    assert blended_tokens(5.0, None, 0, 200) == 5.0
    assert blended_tokens(5.0, 6.0, 0, 200) == 5.0
    assert blended_tokens(5.0, 6.0, 200, 200) == pytest.approx(5.5)
    assert blended_tokens(5.0, 6.0, 10**6, 200) == pytest.approx(6.0, rel=1e-3)
    assert blended_tokens(5.0, 6.0, 3, 0) == 6.0


def test_scored_acceptance_moves_the_choice():
    prices = _prices({"16": 0.02, "32": 0.02}, {"16": 17, "32": 33})
    policy = WidthPolicy(("16", "32"), {"16": 5.0, "32": 5.6}, prices, prior_rounds=100)
    assert policy.table[1] == "32"
    # the server's own rounds say the wide tree accepts less than the narrow one: 16 everywhere
    table = policy.update({"16": (5.0, 10_000), "32": (4.8, 10_000)})
    assert set(table.values()) == {"16"}


def test_a_switch_needs_the_margin():
    prices = {("16", 1): 0.0100, ("32", 1): 0.0100}
    policy = WidthPolicy(("16", "32"), {"16": 5.0, "32": 5.0}, prices, prior_rounds=0, margin=0.02)
    assert policy.table[1] == "16"  # a tie: the first given
    assert policy.update({"16": (5.0, 1), "32": (5.05, 1)})[1] == "16"  # 1 % better: kept
    assert policy.update({"16": (5.0, 1), "32": (5.2, 1)})[1] == "32"  # 4 % better: switched
    assert policy.update({"16": (5.05, 1), "32": (5.0, 1)})[1] == "32"  # and kept the other way too
    unmargined = WidthPolicy(("16", "32"), {"16": 5.0, "32": 5.0}, prices, prior_rounds=0, margin=0)
    assert unmargined.update({"16": (5.0, 1), "32": (5.05, 1)})[1] == "32"


def test_a_round_takes_its_buckets_width():
    prices = {
        (w, b): 0.01 * b * (2 if w == "32" else 1) for w, b in itertools.product(("16", "32"), (1, 4, 16))
    }
    policy = WidthPolicy(("16", "32"), {"16": 5.0, "32": 9.0}, prices)
    for size, bucket in ((1, 1), (2, 4), (4, 4), (5, 16), (16, 16)):
        assert policy.width_for(size) == policy.table[bucket]
    for bad in (0, 17):
        with pytest.raises(WidthPolicyError, match=f"batch size {bad}"):
            policy.width_for(bad)


def test_a_width_missing_at_some_size_is_left_out_there():
    prices = {("16", 1): 0.02, ("32", 1): 0.021, ("16", 16): 0.05}
    policy = WidthPolicy(("16", "32"), {"16": 5.0, "32": 6.0}, prices)
    assert policy.table == {1: "32", 16: "16"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"widths": ()}, "at least one"),
        ({"widths": ("16", "16")}, "each once"),
        ({"priors": {"16": 5.0}}, r"no prior tokens per round for \['32'\]"),
        ({"priors": {"16": 5.0, "32": 0}}, "prior tokens per round of 32 = 0"),
        ({"prices": {}}, "no batch size"),
        ({"prices": {("16", 1): 0.01, ("64", 4): 0.02}}, "batch size 4 has no priced width"),
        ({"prices": {("16", 1): -1.0, ("32", 1): 0.02}}, "round seconds of 16 = -1.0"),
        ({"margin": 1.5}, "margin 1.5"),
    ],
)
def test_bad_input_is_refused_with_the_reason(kwargs, message):
    args = {
        "widths": ("16", "32"),
        "priors": {"16": 5.0, "32": 6.0},
        "prices": {("16", 1): 0.01, ("32", 1): 0.02},
    }
    with pytest.raises(WidthPolicyError, match=message):
        WidthPolicy(**{**args, **kwargs})


def _chooser(**kwargs):
    from ddtree_runtime.core.width_policy import WidthChooser

    prices = _prices({"16": 0.02, "32": 0.02}, {"16": 17, "32": 33})
    return WidthChooser(("16", "32"), prices, **kwargs)


def _run(chooser, sizes, tokens_per_round: dict[str, float]) -> None:
    """Rounds at the given batch sizes; the device's counts read back after each (cumulative)."""
    tokens = chooser.__dict__.setdefault("_test_tokens", {w: 0.0 for w in chooser.widths})
    for size in sizes:
        width = chooser.choose(size)
        tokens[width] += tokens_per_round[width] * size
        chooser.observe(tokens, dict(chooser.dispatched_rows))


def test_the_chooser_runs_every_width_then_picks_by_its_own_rounds():
    chooser = _chooser(explore_rows=8, revisit_every=0)
    _run(chooser, [1] * 15, {"16": 5.0, "32": 5.6})
    assert chooser.exploring  # 32 has 7 of its 8 request-rounds
    _run(chooser, [1], {"16": 5.0, "32": 5.6})
    assert not chooser.exploring
    assert chooser.rounds_run == {"16": 8, "32": 8}  # alternated while exploring
    assert chooser.policy.table[1] == "32" and chooser.policy.table[16] == "16"
    assert [chooser.choose(1), chooser.choose(16)] == ["32", "16"]
    # the same prices with a tree that accepts no more at 32 rows: the narrow one everywhere
    flat = _chooser(explore_rows=8, revisit_every=0)
    _run(flat, [1] * 16 + [16] * 40, {"16": 5.0, "32": 5.0})
    assert set(flat.policy.table.values()) == {"16"}


def test_the_chooser_revisits_the_width_it_does_not_pick():
    chooser = _chooser(explore_rows=4, revisit_every=8)
    _run(chooser, [16] * 4, {"16": 5.0, "32": 5.0})
    picked = [chooser.choose(16) for _ in range(32)]
    assert picked.count("32") == 4 and picked.count("16") == 28  # one round in eight
    assert chooser.choose(99) == "16"  # beyond the largest priced size: the largest size's choice


def test_the_chooser_refuses_what_it_cannot_choose_from():
    from ddtree_runtime.core.width_policy import WidthChooser

    prices = _prices({"16": 0.02}, {"16": 17})
    with pytest.raises(WidthPolicyError, match="width 32 has no price"):
        WidthChooser(("16", "32"), prices)
    with pytest.raises(WidthPolicyError, match="2 or more"):
        WidthChooser(("16",), prices)
    with pytest.raises(WidthPolicyError, match="at least one request"):
        _chooser().choose(0)
    state = _chooser().to_dict()
    assert state["exploring"] and state["table"] == {} and state["rounds"] == {"16": 0, "32": 0}


def test_a_widths_mean_follows_traffic_by_its_half_life():
    chooser = _chooser(explore_rows=1, revisit_every=0, half_life_rows=100)
    chooser.observe({"16": 500.0, "32": 600.0}, {"16": 100, "32": 100})  # 5.0 and 6.0 a request-round
    assert chooser.observed == {"16": (5.0, 100), "32": (6.0, 100)}
    # the next 100 request-rounds of 32 emit 4.0 each: one half-life, so the first 100 weigh 50 against 100
    chooser.observe({"16": 500.0, "32": 1000.0}, {"16": 100, "32": 200})
    assert chooser.observed["32"] == (pytest.approx((6.0 * 50 + 4.0 * 100) / 150), 200)
    assert chooser.observed["16"] == (5.0, 100)
    chooser.observe({"16": 500.0, "32": 1000.0}, {"16": 100, "32": 200})  # nothing new: nothing moves
    assert chooser.observed["32"][0] == pytest.approx(14 / 3)
    # while few rows are in, it is the running average: a first noisy round does not stick
    fresh = _chooser(explore_rows=1, revisit_every=0)
    fresh.observe({"16": 1.0, "32": 1.0}, {"16": 1, "32": 1})
    fresh.observe({"16": 1.0 + 99 * 5.0, "32": 1.0 + 99 * 6.0}, {"16": 100, "32": 100})
    assert fresh.observed["16"][0] == pytest.approx(4.96, abs=0.01) and fresh.observed["32"][0] > 5.9
