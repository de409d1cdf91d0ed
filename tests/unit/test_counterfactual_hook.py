"""The SGLang worker's counterfactual hook, piece by piece, without SGLang (fixed shapes, CPU): the host
sampling decision, release on slot reuse and on leaving the batch, the feed window after a sampled round,
the tree round's tee, the counters' publication and their series (the readers' names).

The hook inside the worker (eager and graph rounds, nothing read back):
tests/sglang/test_counterfactual_hook_sync.py; on real traffic: tests/sglang/test_counterfactual_server.py
(CPU real server) and tests/gpu/test_counterfactual_gpu.py (H200)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from ddtree_runtime.core.counterfactual import (
    DEFAULT_BUDGETS,
    DEFAULT_FRACTION,
    Candidate,
    CounterfactualSettings,
    parse_candidates,
)
from ddtree_runtime.core.tree_types import DraftTopK
from ddtree_runtime.sglang_plugin.counterfactual_hook import (
    CounterfactualHook,
    CounterPublisher,
    RoundSampler,
    SlotBook,
    TeeDraftBlock,
    WorkerScoring,
    _tee_draft_forward,
    head_candidates,
)

L, V = 4, 12  # horizon (block - 1), vocabulary


def req(slot: int, greedy: bool = True) -> SimpleNamespace:
    params = SimpleNamespace(top_k=1 if greedy else 40)  # SGLang's greedy: top_k <= 1
    return SimpleNamespace(kv=SimpleNamespace(req_pool_idx=slot), sampling_params=params)


def hook(
    fraction: float = 1.0, candidates: list[Candidate] | None = None, slots: int = 4
) -> CounterfactualHook:
    cands = candidates or parse_candidates("4,8,chain", L)
    return CounterfactualHook(cands, fraction=fraction, horizon=L, num_slots=slots, device="cpu")


def peaked_logits(b: int, tokens: list[list[int]]) -> torch.Tensor:
    """Draft logits [b, block, V] whose argmax at depth d (1..L) is tokens[r][d - 1]."""
    logits = torch.zeros(b, L + 1, V)
    for r, row in enumerate(tokens):
        for d, t in enumerate(row, start=1):
            logits[r, d, t] = 5.0
    return logits


def run_round(h: CounterfactualHook, reqs, draft: list[list[int]] | None, emitted: list[list[int]],
              stop_of=None):  # fmt: skip
    """One decode round through plan -> take_head -> end, as the worker drives it; the plan."""
    slots = torch.tensor([r.kv.req_pool_idx for r in reqs])
    plan = h.plan(reqs, slots, stop_of)
    if plan is None:
        return None
    if draft is not None:
        h.take_head(plan, peaked_logits(len(reqs), draft).reshape(len(reqs) * (L + 1), V), L + 1)
    width = max(len(e) for e in emitted)
    out = torch.tensor([e + [-1] * (width - len(e)) for e in emitted])
    h.end(plan, out.reshape(-1), torch.tensor([len(e) for e in emitted]))
    return plan


# --- the flags' one check -----------------------------------------------------------------------


def test_settings_resolve_the_flags_and_name_what_is_wrong():
    s = CounterfactualSettings.resolve(0.25, "16, chain", L)
    assert s.enabled and s.candidates == (Candidate(16), Candidate(L, 1))
    assert not CounterfactualSettings.resolve(0.0, DEFAULT_BUDGETS, L).enabled
    for bad in (1.5, -0.1, float("nan"), True):
        with pytest.raises(ValueError, match=r"fraction must be a number in \[0, 1\]"):
            CounterfactualSettings.resolve(bad, DEFAULT_BUDGETS, L)
    with pytest.raises(ValueError, match=r"budgets '16,wide': .*'wide' is neither"):
        CounterfactualSettings.resolve(DEFAULT_FRACTION, "16,wide", L)


# --- the host sampling decision ---------------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.05, 0.2, 1 / 3, 1.0])
def test_the_sampler_takes_exactly_the_fraction_evenly_spaced_from_a_round_counter(fraction):
    sampler = RoundSampler(fraction)
    picks = [n for n in range(600) if sampler.next()]
    assert len(picks) == int(600 * fraction + 1e-9)
    gaps = {b - a for a, b in itertools.pairwise(picks)}
    assert max(gaps, default=1) - min(gaps, default=1) <= 1  # evenly spread, never bunched
    with pytest.raises(ValueError, match="fraction"):
        RoundSampler(0.0)


def test_an_unsampled_round_with_nothing_pending_does_nothing():
    h = hook(fraction=0.1)
    reqs = [req(0), req(1)]  # SGLang keeps a request's object for its life
    plans = [h.plan(reqs, torch.tensor([0, 1])) for _ in range(205)]  # the last sample's window ends inside
    sampled = sum(p is not None and p.sampled for p in plans)
    assert sampled == 20
    # a plan only on sampled rounds and the rounds within the horizon after one
    assert sum(p is not None for p in plans) == sampled * L


def test_t_above_zero_rows_are_not_sampled_and_an_all_t_round_is_not_a_round_to_score():
    h = hook(fraction=1.0)
    plan = h.plan([req(0, greedy=False), req(1)], torch.tensor([0, 1]))
    assert plan is not None and plan.sampled
    assert plan.sample.tolist() == [False, True]
    h2 = hook(fraction=1.0)
    assert h2.plan([req(0, greedy=False), req(1, greedy=False)], torch.tensor([0, 1])) is None


# --- slots: the feed window and release -------------------------------------------------------


def test_a_slot_feeds_for_horizon_rounds_after_its_last_sampled_round():
    book = SlotBook(horizon=3)
    r = req(2)
    assert book.advance([2], [r], [True]) is True
    assert book.left == {2: 2}
    assert book.advance([2], [r], [False]) is True
    assert book.advance([2], [r], [False]) is True
    assert book.left == {} and book.owner == {}  # resolved by now: each round emits a token
    assert book.advance([2], [r], [False]) is False


def test_a_reused_slot_and_a_request_that_left_are_released():
    book = SlotBook(horizon=4)
    old, other = req(1), req(2)
    book.advance([1, 2], [old, other], [True, True])
    new = req(1)
    assert book.stale([1, 2], [new, other]) == [1]  # another request in slot 1
    assert book.stale([2], [other]) == []
    book.advance([3], [req(3)], [True])
    assert sorted(book.stale([2], [other])) == [3]  # slot 3's request is no longer in the batch


def test_a_new_request_in_a_reused_slot_is_not_scored_against_the_old_ones_tokens():
    """Slot 0's request is sampled, then ends before its round resolves; a new request in slot 0 emits
    exactly the old drafts' tokens. Without the release its tokens would complete the old round (a
    full-depth accept); with it the old round is discarded and nothing is scored."""
    h = hook(fraction=0.5, candidates=[Candidate(L, 1)])
    h.sampler.next()  # round 0 of the counter is not sampled at 0.5: the next one is
    first = req(0)
    run_round(h, [first], [[5, 6, 7, 8]], [[5]])  # sampled; nothing past depth 1 known yet
    new = req(0)
    run_round(h, [new], None, [[6, 7, 8, 9]])  # not sampled: only the old round could score
    snap = h.scorer.snapshot()
    assert snap["rounds_sampled"] == 1
    assert snap["rounds_discarded"] == 1 and snap["rounds_scored"] == 0, snap


def test_the_running_chain_is_scored_exactly():
    """A chain candidate fed the emitted tokens of a chain that accepts a then emits a + 1: its accepted
    count is a on every round (the running setting: paired difference 0)."""
    h = hook(fraction=1.0, candidates=parse_candidates("chain,8", L))
    r = req(3)
    drafts = [[1, 2, 3, 4], [9, 9, 9, 9], [5, 6, 2, 2], [7, 7, 7, 7], [1, 1, 1, 1]]
    emitted = [[1, 2, 3, 4, 10], [8], [5, 6, 11], [7, 7, 7, 7, 7], [1, 3]]
    for d, e in zip(drafts, emitted, strict=True):
        run_round(h, [r], [d], [e])
    snap = h.scorer.snapshot()
    chain = next(c for c in snap["candidates"] if c["label"] == "chain")
    scored = snap["rounds_scored"]
    assert scored >= 3
    assert chain["accepted"] + scored == snap["real_emitted"]
    assert chain["tokens_per_round"] == snap["real_emitted"] / scored


def test_a_round_cut_at_a_stop_token_and_the_ride_after_it_leave_the_running_chain_exact():
    """The running chain (its tree round cut at a stop token, ``tree_round.truncate_at_stop``) accepts
    1, 2, 3 then the stop token 4 at its deepest depth: it emits those 4 of its 5 tokens. The overlap
    scheduler's next round still carries the finished request (the model decoding on past its stop). Told
    the request's stop tokens, the hook leaves both cut rounds out; told nothing, the deepest-depth round
    scores one token more than it emitted, the ride completes the other."""
    drafts = [[1, 2, 3, 4], [6, 7, 8, 9], [8, 9, 1, 1]]
    emitted = [[1, 2, 3, 4], [6, 7], [8, 9, 5]]  # rounds 1 and 2 cut at stops 4 and 7; round 3 the ride
    for stop_of, exact in ((lambda r: frozenset({4, 7}), True), (None, False)):
        h = hook(fraction=1.0, candidates=parse_candidates("chain,8", L))
        r = req(2)
        for d, e in zip(drafts, emitted, strict=True):
            run_round(h, [r], [d], [e], stop_of)
        snap = h.scorer.snapshot()
        chain = next(c for c in snap["candidates"] if c["label"] == "chain")
        assert (chain["accepted"] + snap["rounds_scored"] == snap["real_emitted"]) is exact, snap
        if exact:
            assert (snap["rounds_scored"], snap["rounds_discarded"]) == (1, 2)  # the ride itself scores


def test_a_batch_without_stop_tokens_builds_no_table_and_a_batch_keeps_its_own():
    h = hook(fraction=1.0)
    reqs, slots = [req(0), req(1)], torch.tensor([0, 1])
    plan = h.plan(reqs, slots, lambda r: frozenset())
    assert plan is not None and plan.stops is None
    plan = h.plan(reqs, slots, lambda r: frozenset({3, r.kv.req_pool_idx}))
    assert plan.stops.tolist() == [[0, 3], [1, 3]]
    # the same batch's table is kept, not copied again; another batch's sets get their own
    assert h.plan(reqs, slots, lambda r: frozenset({3, r.kv.req_pool_idx})).stops is plan.stops
    assert h.plan(reqs, slots, lambda r: frozenset({7})).stops.tolist() == [[7], [7]]


# --- the drafter's top-K ------------------------------------------------------------------------


def test_the_tree_rounds_head_output_is_teed_and_ranked_at_the_widest_k():
    seen = []
    models = SimpleNamespace(draft_block=lambda *a: torch.ones(2 * (L + 1), V), last_target_out="t")
    tee = TeeDraftBlock(models, seen.append)
    out = tee.draft_block(1, 2, 3, 4)
    assert seen == [out] and tee.last_target_out == "t"
    h = hook(fraction=1.0)
    plan = h.plan([req(0), req(1)], torch.tensor([0, 1]))
    h.take_head(plan, out, L + 1)
    assert plan.top.ids.shape == (2, L, 8)  # the widest candidate's K, from the full logits


def test_the_worker_tees_only_a_sampled_round_and_reads_a_graph_bucket_only_then():
    h = hook(fraction=0.5)
    scoring = WorkerScoring(h, None, lambda rows, k: rows)
    models = SimpleNamespace(draft_block=lambda *a: torch.ones(L + 1, V))
    asked = []
    bucket = SimpleNamespace(depth_logits=lambda b: asked.append(b) or torch.randn(b, L, V))
    batch = SimpleNamespace(reqs=[req(0)], req_pool_indices=torch.tensor([0]))
    scoring.begin(batch)  # round 0: not sampled, nothing pending
    assert scoring.round is None and scoring.models(models, L + 1) is models
    scoring.after_tree_round(bucket)
    assert asked == []
    scoring.begin(batch)  # round 1: sampled
    assert isinstance(scoring.models(models, L + 1), TeeDraftBlock)
    scoring.after_tree_round(None)  # an eager round: its tee gave the top-K (here: none came)
    assert asked == [] and scoring.round.top is None
    scoring.after_tree_round(bucket)
    assert asked == [1] and scoring.round.top.ids.shape == (1, L, 8)


def test_a_narrow_vocabulary_parallel_head_drops_the_candidates_it_cannot_build_whole():
    cands = parse_candidates("8,16,32,chain", 15)
    assert [c.label for c in head_candidates(cands, 16, 1000)] == ["8", "16", "chain"]
    assert head_candidates(cands, None, 1000) == cands
    # a small vocabulary caps every width: budget 32 needs only V tokens
    assert [c.label for c in head_candidates(cands, 16, 16)] == ["8", "16", "32", "chain"]


def test_the_chain_case_ranks_the_drafters_rows_at_the_widest_k():
    h = hook(fraction=1.0)
    plan = h.plan([req(0)], torch.tensor([0]))
    asked = []

    def rank(hidden: torch.Tensor, k: int) -> DraftTopK | torch.Tensor:
        asked.append(k)
        return torch.randn(hidden.shape[0], V)

    h.take_hidden(plan, torch.zeros(L, 3), rank)
    assert asked == [8] and plan.top.ids.shape == (1, L, 8)


def test_the_chain_cases_drafter_pass_is_teed_and_ranked_on_sampled_rounds():
    """DFlash's chain decode: the drafter runner's forward is wrapped once; its TARGET_VERIFY pass (the
    draft block) hands its hidden rows at depths 1..L to the scorer on a sampled round only."""
    block, b, width = L + 1, 2, 3
    hidden = torch.randn(b * block, width)
    calls = []

    class Mode:
        def __init__(self, verify: bool) -> None:
            self.verify = verify

        def is_target_verify(self) -> bool:
            return self.verify

    out = SimpleNamespace(logits_output=SimpleNamespace(hidden_states=hidden))
    runner = SimpleNamespace(forward=lambda fb: out)
    h = hook(fraction=1.0)
    weight = torch.randn(V, width)
    scoring = WorkerScoring(h, None, lambda rows, k: (calls.append(rows.shape), rows @ weight.t())[1])
    _tee_draft_forward(runner, lambda out: scoring.draft_out(out, block))
    batch = SimpleNamespace(reqs=[req(0), req(1)], req_pool_indices=torch.tensor([0, 1]))
    scoring.begin(batch)
    runner.forward(SimpleNamespace(forward_mode=Mode(False)))  # not the draft block: ignored
    assert scoring.round.top is None
    runner.forward(SimpleNamespace(forward_mode=Mode(True)))
    assert calls == [(b * L, width)] and scoring.round.top.ids.shape == (b, L, 8)
    expect = h.scorer.top_from_logits(hidden.view(b, block, -1)[:, 1:] @ weight.t())
    assert torch.equal(scoring.round.top.ids, expect.ids)
    emitted = torch.zeros(b * block, dtype=torch.long)
    scoring.end(SimpleNamespace(next_token_ids=emitted, accept_lens=torch.ones(b, dtype=torch.long)))
    assert h.scorer.snapshot()["rounds_sampled"] == 2


# --- publication --------------------------------------------------------------------------------


def test_the_counter_vector_reads_back_as_the_snapshot():
    h = hook(fraction=1.0)
    for d, e in [([1, 2, 3, 4], [1, 2, 9]), ([9, 9, 9, 9], [9, 9]), ([3, 3, 3, 3], [3, 3, 3, 3, 3])]:
        run_round(h, [req(1)], [d], [e])
    vec = h.scorer.counter_vector()
    assert vec.dtype == torch.float64 and vec.device == h.scorer.device
    assert h.scorer.snapshot_from(vec.tolist()) == h.scorer.snapshot()
    assert h.scorer.snapshot()["rounds_scored"] > 0
    with pytest.raises(ValueError, match="counter vector"):
        h.scorer.snapshot_from(vec.tolist()[:-1])


def test_the_publisher_sends_each_change_once_and_flushes_when_idle():
    h = hook(fraction=1.0)
    sent = []
    now = [0.0]
    pub = CounterPublisher(h, sent.append, interval_s=10.0, clock=lambda: now[0])
    pub.after_round()
    assert len(sent) == 1 and sent[0]["rounds_scored"] == 0  # every series exists from the start
    pub.after_round()
    assert len(sent) == 1  # nothing new
    run_round(h, [req(0)], [[1, 2, 3, 4]], [[1, 2, 9]])
    pub.after_round()
    assert len(sent) == 1  # within the interval
    now[0] = 11.0
    pub.after_round()
    assert len(sent) == 2  # CPU: published at once
    run_round(h, [req(0)], [[9, 9, 9, 9]], [[9, 9]])
    pub.after_round()
    assert len(sent) == 2  # within the interval
    pub.flush()
    pub.flush()
    assert len(sent) == 3 and sent[-1] == h.scorer.snapshot()


def test_counters_carry_the_readers_names_labels_and_values():
    from prometheus_client import CollectorRegistry, generate_latest

    from ddtree_runtime.core.counterfactual_invariants import CANDIDATE_COUNTERS, ROUND_COUNTERS
    from ddtree_runtime.health.counterfactual_counters import estimates, parse_metrics, read_counters
    from ddtree_runtime.sglang_plugin.counterfactual_metrics import PER_BUDGET, ROUNDS, CounterfactualMetrics
    from ddtree_runtime.tiny_engine.serving_metrics import COUNTERFACTUAL_PER_BUDGET, COUNTERFACTUAL_ROUNDS

    assert tuple(ROUNDS) == ROUND_COUNTERS and tuple(PER_BUDGET) == CANDIDATE_COUNTERS
    assert set(ROUNDS) == set(COUNTERFACTUAL_ROUNDS) and set(PER_BUDGET) == set(COUNTERFACTUAL_PER_BUDGET)
    h = hook(fraction=1.0)
    drafts = [[1, 2, 3, 4], [9, 9, 9, 9], [1, 1, 1, 1], [2, 2, 2, 2]]
    emitted = [[1, 2, 9], [9, 9], [3], [2, 2, 2, 2, 2]]
    for d, e in zip(drafts, emitted, strict=True):
        run_round(h, [req(0)], [d], [e])
    registry = CollectorRegistry()
    metrics = CounterfactualMetrics("m", registry=registry)
    metrics.update(h.scorer.snapshot())
    metrics.update(h.scorer.snapshot())  # no change: no double count
    text = generate_latest(registry).decode()
    counts = parse_metrics(text)
    snap = h.scorer.snapshot()
    assert counts["rounds_scored"] == snap["rounds_scored"] > 0
    assert counts["real_emitted_tokens"] == snap["real_emitted"]
    assert counts["real_emitted_tokens_squared"] == snap["real_emitted_sq"]
    for cand in snap["candidates"]:
        got = counts["budgets"][cand["label"]]
        assert got["accepted_tokens"] == cand["accepted"]
        assert got["accepted_tokens_squared"] == cand["accepted_sq"]
        assert got["accepted_tokens_x_real"] == cand["accepted_x_real"]
        assert got["round_weight"] == pytest.approx(cand["round_weight"])
    checked = read_counters(text, horizon=L)  # every invariant a real scorer keeps
    assert {e.label for e in estimates(checked)} == {"4", "8", "chain"}


def test_the_flag_defaults_are_the_lab_engines():
    from ddtree_runtime.sglang_plugin import cli_args
    from ddtree_runtime.tiny_engine import server_args

    assert cli_args.DEFAULT_FRACTION == server_args.DEFAULT_COUNTERFACTUAL_FRACTION
    # the plugin scores nothing unless asked until the GPU suite and the cost at 27B have run it
    assert cli_args.PLUGIN_DEFAULT_FRACTION == 0.0
    assert cli_args.DEFAULT_BUDGETS == server_args.DEFAULT_COUNTERFACTUAL_BUDGETS
