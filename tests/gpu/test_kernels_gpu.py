"""The Triton round on a real GPU: same results as the plain path, dispatch, CUDA graph, no host sync."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from ddtree_runtime.core import kernels, tree  # noqa: E402

DEV = "cuda"


def assert_same(a, b, what: str = "") -> None:
    if dataclasses.is_dataclass(a):
        assert type(a) is type(b)
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{what}.{f.name}")
    elif isinstance(a, tuple):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype, what
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True, msg=what)
        else:
            assert torch.equal(a, b), f"{what}: {a} != {b}"
    else:
        assert a == b, what


def plain(monkeypatch, fn, *args, **kwargs):
    with monkeypatch.context() as m:
        m.setenv("DDTREE_DISABLE_KERNELS", "1")
        return fn(*args, **kwargs)


def full_round(mod, draft, target, roots, prefix, budget, page_size=1, topk_cap=None):
    t = mod.build_tree(draft, budget, topk_cap=topk_cap)
    v = mod.compile_tree(t, roots, prefix)
    w = mod.walk_greedy(t, target)
    c = mod.commit_plan(w, prefix, page_size=page_size)
    return t, v, w, c


def follow_draft(draft, target, t):
    """Target argmax = draft argmax chain at most rows, so walks accept several nodes."""
    horizon = draft.shape[1]
    chain = draft.float().argmax(-1)
    row_depth = torch.cat([torch.zeros_like(t.depths[:, :1]), t.depths], 1).clamp(max=horizon - 1)
    target.scatter_(2, chain.gather(1, row_depth).unsqueeze(-1), 50.0)


def test_available_on_cuda():
    assert kernels.available()


@pytest.mark.parametrize(
    ("batch", "horizon", "vocab", "budget", "dtype", "cap"),
    [
        (1, 15, 248320, 64, torch.bfloat16, None),
        (3, 15, 248320, 256, torch.bfloat16, None),
        (4, 15, 32000, 16, torch.float32, None),
        (2, 7, 5000, 300, torch.float16, None),
        (2, 15, 9000, 100, torch.bfloat16, 4),
        (3, 4, 10, 64, torch.float32, None),  # budget > vocab
        (2, 3, 4, 200, torch.float32, None),  # fewer prefixes than the budget: padding
    ],
)
def test_round_matches_plain_path(monkeypatch, batch, horizon, vocab, budget, dtype, cap):
    """Stage by stage on the same inputs: the kernels' logsumexp sums in another order than
    PyTorch's, so log-probs may differ by an ulp, which flips path scores that tie within an ulp."""
    from ddtree_runtime.core.kernels.topk import topk_log_probs

    gen = torch.Generator(device=DEV).manual_seed(batch * 1000 + budget)
    draft = (torch.randn((batch, horizon, vocab), device=DEV, generator=gen) * 3).to(dtype)
    target = torch.randn((batch, budget + 1, vocab), device=DEV, generator=gen).to(dtype)
    roots = torch.randint(0, vocab, (batch,), device=DEV, generator=gen)
    prefix = torch.randint(0, 500, (batch,), device=DEV, generator=gen)
    k = min(budget, vocab, cap or budget)
    lp, ids = topk_log_probs(draft, k)
    want_lp, want_ids = tree.topk_log_probs(draft, k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-5)
    t = tree.build_tree(draft, budget, topk_cap=cap)  # dispatches to the kernels
    for r in range(batch):
        toks, deps, pars, _ = tree._reference_build_tree(lp[r].tolist(), ids[r].tolist(), budget)
        n = len(toks)
        assert t.tokens[r, :n].tolist() == toks
        assert t.depths[r, :n].tolist() == deps
        assert t.parents[r, : n + 1].tolist() == pars
        assert (t.tokens[r, n:] == -1).all()
    follow_draft(draft, target, t)
    verify = tree.compile_tree(t, roots, prefix)
    assert_same(verify, plain(monkeypatch, tree.compile_tree, t, roots, prefix), "verify")
    walk = tree.walk_greedy(t, target)
    assert_same(walk, plain(monkeypatch, tree.walk_greedy, t, target), "walk")
    plan = tree.commit_plan(walk, prefix, page_size=16)
    assert_same(plan, plain(monkeypatch, tree.commit_plan, walk, prefix, page_size=16), "plan")
    assert int(walk.num_accepted.max()) > 1  # the walk really went down the tree


def test_large_budget_stage_by_stage(monkeypatch):
    """B = 1024: path scores of different nodes come within an ulp of the log-probs, where the
    kernels' and PyTorch's logsumexp (summed in another order) may round apart; so each stage is
    compared on the same inputs: top-K with the plain top-K, the tree with the reference heap on
    the kernels' top-K, and compile / walk / commit with the plain functions on the same tree."""
    from ddtree_runtime.core.kernels.topk import topk_log_probs

    gen = torch.Generator(device=DEV).manual_seed(11)
    batch, budget, vocab = 2, 1024, 248320
    draft = torch.randn((batch, 15, vocab), device=DEV, generator=gen) * 2
    # A confident drafter (one strong token per depth) so that the tree and the walk go deep.
    peak = torch.randint(0, vocab, (batch, 15, 1), device=DEV, generator=gen)
    draft = draft.scatter_add(2, peak, torch.full_like(peak, 14.0, dtype=draft.dtype)).to(torch.bfloat16)
    lp, ids = topk_log_probs(draft, budget)
    want_lp, want_ids = tree.topk_log_probs(draft, budget)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=2e-6)
    t = kernels.build_tree(draft, budget)
    for r in range(batch):
        toks, deps, pars, _ = tree._reference_build_tree(lp[r].tolist(), ids[r].tolist(), budget)
        assert t.tokens[r].tolist() == toks
        assert t.depths[r].tolist() == deps
        assert t.parents[r].tolist() == pars
    target = torch.randn((batch, budget + 1, vocab), device=DEV, generator=gen).to(torch.bfloat16)
    follow_draft(draft, target, t)
    roots = torch.randint(0, vocab, (batch,), device=DEV, generator=gen)
    prefix = torch.tensor([7, 300], device=DEV)
    want_verify = plain(monkeypatch, tree.compile_tree, t, roots, prefix)
    assert_same(kernels.compile_tree(t, roots, prefix), want_verify)
    walk = kernels.walk_greedy(t, target)
    assert_same(walk, plain(monkeypatch, tree.walk_greedy, t, target))
    assert int(walk.num_accepted.min()) > 3
    for page in (1, 64):
        assert_same(
            kernels.commit_plan(walk, prefix, page_size=page),
            plain(monkeypatch, tree.commit_plan, walk, prefix, page_size=page),
        )


@pytest.mark.parametrize("budget", [8, 64, 300])
def test_exact_ties_match_plain_path(monkeypatch, budget):
    # Integer logits: many equal log-probs inside each depth's top-K and equal path scores.
    gen = torch.Generator(device=DEV).manual_seed(budget)
    vocab = 4096
    draft = torch.randint(0, 3, (2, 15, vocab), device=DEV, generator=gen).to(torch.bfloat16)
    draft[..., :600] += 5  # the top-K is strictly inside the 600 raised ids: no boundary ties
    target = torch.randint(0, 2, (2, budget + 1, vocab), device=DEV, generator=gen).float()
    roots = torch.zeros(2, dtype=torch.long, device=DEV)
    prefix = torch.tensor([3, 40], device=DEV)
    want = plain(monkeypatch, full_round, tree, draft, target, roots, prefix, budget)
    got = full_round(kernels, draft, target, roots, prefix, budget)
    assert_same(got, want, "ties")


def test_tree_matches_reference_heap():
    gen = torch.Generator(device=DEV).manual_seed(7)
    draft = torch.randn((3, 15, 50000), device=DEV, generator=gen).to(torch.bfloat16)
    t = kernels.build_tree(draft, 200)
    lp, ids = tree.topk_log_probs(draft, 200)
    for r in range(3):
        toks, deps, pars, scores = tree._reference_build_tree(lp[r].tolist(), ids[r].tolist(), 200)
        assert t.tokens[r].tolist() == toks
        assert t.depths[r].tolist() == deps
        assert t.parents[r].tolist() == pars
        torch.testing.assert_close(t.scores[r].double().cpu(), torch.tensor(scores, dtype=torch.float64))


def test_dispatch_goes_to_kernels_on_cuda(monkeypatch):
    calls = []
    real = kernels.build_tree

    def spy(*args, **kwargs):
        calls.append(args[0].device.type)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "build_tree", spy)
    tree.build_tree(torch.randn(1, 3, 100, device=DEV), 8)
    tree.build_tree(torch.randn(1, 3, 100), 8)  # CPU: plain path
    plain(monkeypatch, tree.build_tree, torch.randn(1, 3, 100, device=DEV), 8)
    assert calls == ["cuda"]


def test_round_has_no_host_sync():
    vocab, budget = 248320, 64
    draft = torch.randn((2, 15, vocab), device=DEV).to(torch.bfloat16)
    target = torch.randn((2, budget + 1, vocab), device=DEV).to(torch.bfloat16)
    roots = torch.zeros(2, dtype=torch.long, device=DEV)
    prefix = torch.tensor([5, 9], device=DEV)
    full_round(kernels, draft, target, roots, prefix, budget)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        full_round(kernels, draft, target, roots, prefix, budget)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_replay_with_new_logits(monkeypatch):
    vocab, budget, batch = 248320, 64, 4
    gen = torch.Generator(device=DEV).manual_seed(3)
    draft = torch.empty((batch, 15, vocab), device=DEV, dtype=torch.bfloat16)
    target = torch.empty((batch, budget + 1, vocab), device=DEV, dtype=torch.bfloat16)
    roots = torch.zeros(batch, dtype=torch.long, device=DEV)
    prefix = torch.full((batch,), 100, device=DEV)

    def fresh():
        d = torch.randn((batch, 15, vocab), device=DEV, generator=gen).to(torch.bfloat16)
        t = torch.randn((batch, budget + 1, vocab), device=DEV, generator=gen).to(torch.bfloat16)
        follow_draft(d, t, kernels.build_tree(d, budget))
        return d, t, torch.randint(0, vocab, (batch,), device=DEV, generator=gen)

    d, t, r = fresh()
    draft.copy_(d), target.copy_(t), roots.copy_(r)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        full_round(kernels, draft, target, roots, prefix, budget)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = full_round(kernels, draft, target, roots, prefix, budget)
    for _ in range(3):
        d, t, r = fresh()
        draft.copy_(d), target.copy_(t), roots.copy_(r)
        graph.replay()
        torch.cuda.synchronize()
        want = plain(monkeypatch, full_round, tree, d, t, r, prefix, budget)
        assert_same(static_out, want, "graph")


def test_sharded_head_is_the_single_rank_tree_without_sync_and_in_a_graph():
    """TP 2's drafter head on one GPU (the all-gather stands in as a concatenation): shard top-K in
    the kernel, the merge in torch; no host sync, captured in a CUDA graph and replayed with new
    logits; the tree = the single-rank kernel tree over the full vocabulary."""
    from ddtree_runtime.core.tp_head import VocabShard, merge, pack, shard_topk

    vocab, budget, batch, horizon = 248320, 64, 4, 15
    gen = torch.Generator(device=DEV).manual_seed(7)
    logits = torch.empty((batch * horizon, vocab), device=DEV)
    half = vocab // 2
    shards = [VocabShard(0, half, vocab), VocabShard(half, vocab - half, vocab)]

    def sharded():
        bufs = [pack(*shard_topk(logits[:, s.start : s.start + s.num], s, budget)) for s in shards]
        return merge(torch.cat(bufs), 2, budget).reshape(batch, horizon)

    logits.copy_(torch.randn(logits.shape, device=DEV, generator=gen) * 3)
    sharded()  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sharded()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sharded()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_top = sharded()
    for _ in range(2):
        logits.copy_(torch.randn(logits.shape, device=DEV, generator=gen) * 3)
        logits[:horizon, half - 40 : half + 40] = 20.0  # 80 tied leaders > K, across the shard cut
        graph.replay()
        torch.cuda.synchronize()
        want = kernels.build_tree(logits.view(batch, horizon, vocab), budget)
        assert torch.equal(static_top.ids, tree.topk_log_probs(logits.view(batch, horizon, vocab), budget)[1])
        assert_same(kernels.build_tree_from_topk(static_top, budget), want, "graph")


@pytest.mark.parametrize("rows", [1, 15, 480])
@pytest.mark.parametrize("k", [16, 64, 256, 1024])
@pytest.mark.parametrize("variant", ["planned", "tight_buffer", "many_chunks"])
def test_topk_is_the_stable_order_full_vocab(rows, k, variant):
    from ddtree_runtime.core.kernels.topk import plan, topk_log_probs

    if variant == "many_chunks" and k > 64:
        pytest.skip("chunks of 4 tiles keep ~2 KC keys each: pairwise ranking of them is the slow path")
    vocab = 248320
    gen = torch.Generator(device=DEV).manual_seed(rows * 7 + k)
    x = (torch.randn((rows, vocab), device=DEV, generator=gen) * 2).to(torch.bfloat16)
    kc, tile, _ = plan(rows, vocab, k)
    opts = {
        "tight_buffer": {"cap": 1 << (2 * kc + tile - 1).bit_length()},
        "many_chunks": {"chunk": 4 * tile},
    }.get(variant, {})
    lp, ids = topk_log_probs(x, k, **opts)
    # The stable order: logit descending, equal logits by ascending id; values: their log-probs.
    want = torch.sort(x.float(), dim=-1, descending=True, stable=True).indices[:, :k]
    want_lp = torch.log_softmax(x.float(), -1).gather(-1, want)
    bad = (ids != want).nonzero()
    if len(bad):
        r, j = bad[0].tolist()
        lo = max(j - 2, 0)
        pytest.fail(
            f"{len(bad)} ids differ (rows {sorted(set(bad[:, 0].tolist()))[:8]}); first row {r} rank {j}: "
            f"got {ids[r, lo : j + 3].tolist()} lp {lp[r, lo : j + 3].tolist()}, "
            f"want {want[r, lo : j + 3].tolist()} lp {want_lp[r, lo : j + 3].tolist()}"
        )
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("batch", "budget"), [(1, 64), (4, 1024), (32, 64)])
def test_lazy_and_full_walk_match_plain(monkeypatch, batch, budget):
    from ddtree_runtime.core.kernels.walk import walk_arrays

    vocab = 248320
    gen = torch.Generator(device=DEV).manual_seed(batch + budget)
    draft = torch.randn((batch, 15, vocab), device=DEV, generator=gen) * 2
    # A confident drafter (one strong token per depth) so that the tree and the walk go deep.
    peak = torch.randint(0, vocab, (batch, 15, 1), device=DEV, generator=gen)
    draft = draft.scatter_add(2, peak, torch.full_like(peak, 14.0, dtype=draft.dtype)).to(torch.bfloat16)
    t = kernels.build_tree(draft, budget)
    target = torch.randn((batch, budget + 1, vocab), device=DEV, generator=gen).to(torch.bfloat16)
    follow_draft(draft, target, t)
    want = plain(monkeypatch, tree.walk_greedy, t, target)
    for lazy in (False, True):
        acc, num, bonus, emit, num_emit = walk_arrays(t.tokens, t.parents, 15, target, lazy=lazy)
        assert torch.equal(acc, want.accepted), lazy
        assert torch.equal(num, want.num_accepted), lazy
        assert torch.equal(bonus, want.bonus), lazy
        assert torch.equal(emit, want.emitted), lazy
        assert torch.equal(num_emit, want.num_emitted), lazy
    assert int(want.num_accepted.max()) > 3
