"""Counterfactual scoring inside ``DDTreeWorker.forward_batch_generation`` on CPU: the hook reads nothing
back from the device on the decode path (SGLang's overlap contract; the device is simulated as in
tests/sglang/test_tree_round_sync.py: every tensor that would live on the GPU is a ``DeviceTensor`` whose
host reads raise), for tree rounds run eagerly and through the round's graph buckets
(``round_graphs``, ``capture=False``: the same stages on the same static buffers), and the server's own
budget comes out scored exactly on both paths (accepted + 1 = what each real round emitted). Also: the
hook's own calls with marked tensors (sampled rounds, feeding rounds, a release on slot reuse, a T > 0
row, the chain's drafter rows, the publisher's round-side path), and fraction 0 building nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ddtree_runtime.core.counterfactual import CounterfactualSettings, parse_candidates
from ddtree_runtime.sglang_plugin.counterfactual_hook import (
    CounterfactualHook,
    CounterPublisher,
    WorkerScoring,
)
from tests.sglang._device_guard import DeviceTensor, HostRead, on_device, on_host
from tests.sglang.test_tree_decode_worker import BLOCK, BUDGET
from tests.sglang.test_tree_round_sync import _guarded_worker, _overlap_batch

pytestmark = pytest.mark.sglang

L = BLOCK - 1
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7, 1, 8]]


def _req(slot: int, greedy: bool = True, stops: set[int] | None = None) -> SimpleNamespace:
    params = SimpleNamespace(top_k=1 if greedy else 20, stop_token_ids=stops, ignore_eos=False)
    return SimpleNamespace(kv=SimpleNamespace(req_pool_idx=slot), sampling_params=params, eos_token_ids=set())


def _guard_scorer(hook: CounterfactualHook) -> None:
    for name, value in vars(hook.scorer).items():
        if isinstance(value, torch.Tensor):
            setattr(hook.scorer, name, on_device(value))


def _unguard_scorer(hook: CounterfactualHook) -> None:
    for name, value in vars(hook.scorer).items():
        if isinstance(value, torch.Tensor):
            setattr(hook.scorer, name, on_host(value))


def _scored_worker(prompts, *, graphs: bool, fraction: float = 1.0, budgets: str = f"2,{BUDGET},chain",
                   stop_of=None):  # fmt: skip
    worker, toy, rows, bonus, _ = _guarded_worker(1, prompts, [])
    if graphs:
        from tests.sglang.test_round_graphs import _graphs

        kv = worker._target_worker.model_runner.token_to_kv_pool
        worker._round_graphs = _graphs(worker._round_config(), kv, sizes=[1, 2, 4], vocab=toy.target.vocab)
        toy.prefix_always_visible = True
        for bucket in worker._round_graphs.buckets.values():  # the graphs' static buffers live on the device
            for name, value in vars(bucket).items():
                if isinstance(value, torch.Tensor):
                    setattr(bucket, name, on_device(value))
    num_slots = int(worker._target_worker.model_runner.req_to_token_pool.req_to_token.shape[0])
    hook = CounterfactualHook(parse_candidates(budgets, L), fraction=fraction, horizon=L, num_slots=num_slots,
                              device="cpu")  # fmt: skip
    _guard_scorer(hook)
    published: list[dict] = []
    worker._ddtree_scoring = WorkerScoring(
        hook, CounterPublisher(hook, published.append, async_copy=True), lambda h, k: h, stop_of
    )
    return worker, toy, rows, bonus, hook, published


def _decode(worker, rows, bonus, prompts, rounds: int, reqs) -> list[list[int]]:
    """Greedy rounds as the overlap scheduler hands them over; the same request objects every round."""
    seq_lens = [len(p) for p in prompts]
    out = [[b] for b in bonus]
    draft_input = None
    for _ in range(rounds):
        batch = _overlap_batch(rows, seq_lens, [o[-1] for o in out], draft_input)
        batch.reqs = reqs
        result = worker.forward_batch_generation(batch, on_publish=lambda lens: None)
        tokens = on_host(result.next_token_ids).view(len(rows), -1)
        for i in range(len(rows)):
            out[i].extend(tokens[i, : int(on_host(result.accept_lens)[i])].tolist())
        seq_lens = on_host(result.new_seq_lens).tolist()
        draft_input = result.next_draft_input
    return out


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "round-graphs"])
def test_the_worker_scores_its_own_budget_exactly_and_reads_nothing_back(graphs):
    worker, toy, rows, bonus, hook, published = _scored_worker(PROMPTS, graphs=graphs)
    reqs = [_req(r) for r in rows]
    out = _decode(worker, rows, bonus, PROMPTS, 6, reqs)
    for p, got in zip(PROMPTS, out, strict=True):
        assert got == toy.target.reference_greedy(p, len(got))  # scoring changes nothing
    assert isinstance(hook.scorer.accepted, DeviceTensor)
    _unguard_scorer(hook)
    snap = hook.scorer.snapshot()
    n, real = snap["rounds_scored"], snap["real_emitted"]
    assert snap["rounds_sampled"] == 6 * len(rows) and n >= 3 * len(rows)
    own = next(c for c in snap["candidates"] if c["label"] == str(BUDGET))
    assert own["accepted"] + n == real  # every scored round: what the real round emitted
    assert own["round_weight"] == pytest.approx(n)
    assert own["accepted_x_real"] == snap["real_emitted_sq"] - real
    chain = next(c for c in snap["candidates"] if c["label"] == "chain")
    assert chain["accepted"] <= own["accepted"]  # the chain is inside the budget-7 tree here (L = 3)
    # the first round's counters, copied after it and published after the next (the copy's event is done)
    assert published and published[0]["rounds_sampled"] == len(rows)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "round-graphs"])
def test_a_round_cut_at_a_stop_token_leaves_the_running_budget_exact(graphs):
    """Each request stops at a token of its greedy output: the tree round cuts its walk there
    (``truncate_at_stop``) and, as under the overlap scheduler, the finished request rides the next rounds
    (the same batch here). Told the round's stop rule (``ddtree_info.stop_ids``, as ``build_scoring``
    passes it), the scorer leaves the cut rounds and the rides' tokens out of the running budget's rounds:
    accepted + 1 = what each scored round emitted."""
    from ddtree_runtime.sglang_plugin.ddtree_info import stop_ids

    worker, toy, rows, bonus, hook, _ = _scored_worker(PROMPTS, graphs=graphs, stop_of=stop_ids)
    stops = [{toy.target.reference_greedy(p, 8)[k]} for p, k in zip(PROMPTS, (3, 5, 2), strict=True)]
    reqs = [_req(r, stops=s) for r, s in zip(rows, stops, strict=True)]
    out = _decode(worker, rows, bonus, PROMPTS, 6, reqs)
    assert all(s & set(o) for s, o in zip(stops, out, strict=True))  # every request met its stop
    _unguard_scorer(hook)
    snap = hook.scorer.snapshot()
    own = next(c for c in snap["candidates"] if c["label"] == str(BUDGET))
    assert own["accepted"] + snap["rounds_scored"] == snap["real_emitted"], snap
    assert snap["rounds_scored"] > 0 and snap["rounds_discarded"] > 0


def test_a_graph_round_is_scored_from_the_bucket_after_its_replay():
    """With the round's graphs the eager head is never called: the top-K comes from the bucket."""
    worker, _toy, rows, bonus, hook, _ = _scored_worker(PROMPTS[:2], graphs=True)
    calls = []
    for bucket in worker._round_graphs.buckets.values():
        depth_logits = bucket.depth_logits
        bucket.depth_logits = lambda b, f=depth_logits: calls.append(b) or f(b)
    _decode(worker, rows, bonus, PROMPTS[:2], 3, [_req(r) for r in rows])
    assert calls == [2, 2, 2]
    _unguard_scorer(hook)
    assert hook.scorer.snapshot()["rounds_sampled"] == 6


def test_rounds_between_samples_cost_nothing_once_resolved():
    """At fraction 1/8 most rounds neither sample nor feed: no plan, no tee, no scorer call."""
    worker, _toy, rows, bonus, hook, _ = _scored_worker(PROMPTS[:1], graphs=False, fraction=1 / 8)
    calls = []
    observe = hook.scorer.observe
    hook.scorer.observe = lambda *a, **k: calls.append(1) or observe(*a, **k)
    _decode(worker, rows, bonus, PROMPTS[:1], 16, [_req(r) for r in rows])
    # rounds 7 and 15 are sampled; each feeds its own round and at most L - 1 after it
    assert 2 <= len(calls) <= 2 + (L - 1)


def test_fraction_zero_builds_and_runs_nothing(monkeypatch):
    from ddtree_runtime.sglang_plugin import counterfactual_hook

    def boom(*a, **k):
        raise AssertionError("built a scorer at fraction 0")

    monkeypatch.setattr(counterfactual_hook, "build_scoring", boom)
    worker, toy, rows, bonus, _ = _guarded_worker(1, PROMPTS[:1], [])
    off = CounterfactualSettings.resolve(0.0, "8,chain", L)
    worker.ddtree_settings = worker.ddtree_settings.__class__(
        worker.ddtree_settings.decoder, counterfactual=off
    )
    worker._ddtree_scoring = None
    out = _decode(worker, rows, bonus, PROMPTS[:1], 2, [_req(r) for r in rows])
    assert out[0] == toy.target.reference_greedy(PROMPTS[0], len(out[0]))
    assert worker._ddtree_scoring is False  # decided once: off


# --- the hook alone, every input marked --------------------------------------------------------

V = 40


def _round(h: CounterfactualHook, reqs, gen: torch.Generator, chain: bool = False) -> None:
    b = len(reqs)
    slots = on_device(torch.tensor([r.kv.req_pool_idx for r in reqs]))
    plan = h.plan(reqs, slots)
    if plan is None:
        return
    if chain:
        weight = on_device(torch.randn(8, V, generator=gen))
        h.take_hidden(
            plan, on_device(torch.randn(b * L, 8, generator=gen)), lambda hidden, k: hidden @ weight
        )
    else:
        h.take_head(plan, on_device(torch.randn(b * (L + 1), V, generator=gen)), L + 1)
    num = on_device(torch.randint(1, L + 2, (b,), generator=gen))
    emitted = on_device(torch.randint(0, V, (b * (L + 1),), generator=gen))
    h.end(plan, emitted, num)


@pytest.mark.parametrize("chain", [False, True])
def test_the_hook_reads_nothing_back(chain):
    gen = torch.Generator().manual_seed(0)
    h = CounterfactualHook(
        parse_candidates("2,4,chain", L), fraction=0.5, horizon=L, num_slots=6, device="cpu"
    )
    _guard_scorer(h)
    sent: list[dict] = []
    pub = CounterPublisher(h, sent.append, interval_s=0.0, async_copy=True)  # CUDA's way: copy, publish later
    a, b, c = _req(0), _req(1), _req(2, greedy=False)
    for _ in range(6):
        _round(h, [a, b, c], gen, chain)
        pub.after_round()
    _round(h, [_req(0), b], gen, chain)  # slot 0 reused, slot 2 left: both released
    assert len(sent) >= 3 and sent[-1]["rounds_sampled"] <= 6
    with pytest.raises(HostRead):  # a publisher reading the scorer at once would sync inside the round
        CounterPublisher(h, sent.append, async_copy=False).after_round()
    _unguard_scorer(h)
    counts = h.scorer.snapshot()
    assert counts["rounds_sampled"] == 6  # 3 sampled rounds x 2 greedy rows; the T > 0 row never
    assert counts["rounds_scored"] + counts["rounds_discarded"] > 0


def test_the_guard_sees_a_host_read():
    h = CounterfactualHook(parse_candidates("2,chain", L), fraction=1.0, horizon=L, num_slots=2, device="cpu")
    _guard_scorer(h)
    with pytest.raises(HostRead):
        h.scorer.snapshot()


# --- the worker's scoring from its settings ----------------------------------------------------


def _fake_worker(settings, vocab: int = 50, hidden: int = 6) -> SimpleNamespace:
    lm_head = SimpleNamespace(weight=torch.randn(vocab, hidden))
    runner = SimpleNamespace(
        model=SimpleNamespace(lm_head=lm_head),
        req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(9, 64, dtype=torch.int32)),
    )
    return SimpleNamespace(
        ddtree_settings=settings,
        target_worker=SimpleNamespace(model_runner=runner),
        model_runner=SimpleNamespace(model_config=SimpleNamespace(vocab_size=vocab)),
        draft_model_runner=SimpleNamespace(forward=lambda fb: None),
        device=torch.device("cpu"),
    )


@pytest.mark.parametrize("chain", [False, True])
def test_build_scoring_builds_the_hook_from_the_settings_and_compiles_every_candidate_first(
    monkeypatch, chain
):
    import sglang.srt.runtime_context as runtime_context

    from ddtree_runtime.core.decoder_settings import DecoderSettings
    from ddtree_runtime.sglang_plugin import counterfactual_hook
    from ddtree_runtime.sglang_plugin.algorithm import PluginSettings

    monkeypatch.setattr(
        runtime_context, "get_parallel", lambda: SimpleNamespace(tp_group=None, attn_tp_rank=0)
    )
    built = []
    trees = counterfactual_hook.CounterfactualScorer.trees
    monkeypatch.setattr(counterfactual_hook.CounterfactualScorer, "trees",
                        lambda self, top: built.append(tuple(top.ids.shape)) or trees(self, top))  # fmt: skip
    decoder = DecoderSettings.chain(BLOCK) if chain else DecoderSettings(BUDGET, BLOCK)
    cf = CounterfactualSettings.resolve(0.25, "2,8,chain", L)
    worker = _fake_worker(PluginSettings(decoder, counterfactual=cf))
    forward = worker.draft_model_runner.forward
    scoring = counterfactual_hook.build_scoring(worker, model_name=None)
    assert [c.label for c in scoring.hook.scorer.candidates] == ["2", "8", "chain"]
    assert scoring.hook.sampler.fraction == 0.25 and scoring.hook.scorer.num_slots == 9
    assert scoring.publisher is None  # --enable-metrics off: scored, not published
    assert built == [(1, L, 8)]  # every candidate's tree built once before any round
    assert (worker.draft_model_runner.forward is not forward) is chain  # the chain's drafter pass teed
    off = _fake_worker(PluginSettings(decoder, counterfactual=CounterfactualSettings.resolve(0.0, "8", L)))
    assert counterfactual_hook.build_scoring(off, model_name="m") is None
