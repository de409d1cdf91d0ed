"""The Triton kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1), small shapes.

Same contract as ``ddtree_runtime.core.tree``: every result is compared with the plain path (and the
tree with the literal reference heap), including exact ties, budgets larger than the vocabulary,
a top-K cap and masked (-inf) vocabulary.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

torch = pytest.importorskip("torch")
if torch.cuda.is_available():
    # tests/gpu covers the compiled kernels there; the interpreter flag below would turn every
    # Triton kernel of this process into the CPU interpreter.
    pytest.skip("CUDA present: the compiled kernels are tested in tests/gpu", allow_module_level=True)
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    # triton.jit reads the flag when a function is decorated, triton.language's own helpers
    # (tl.max, ...) included: once triton is imported without it, the interpreter cannot run.
    pytest.skip(
        "triton was imported earlier in this process without TRITON_INTERPRET=1 "
        "(scripts/test.sh sets it for the whole run on machines without CUDA)",
        allow_module_level=True,
    )
# Must be set before triton is imported (see above).
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ddtree_runtime.core import kernels, tree  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 before triton is imported"
)


def assert_same(a, b, what: str = "") -> None:
    if dataclasses.is_dataclass(a):
        assert type(a) is type(b), what
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{what}.{f.name}")
    elif isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype}, {b.shape}/{b.dtype}"
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True, msg=what)
        else:
            assert torch.equal(a, b), f"{what}:\n{a}\n!=\n{b}"
    else:
        assert a == b, what


def stable_topk(logits, k):
    """The intended order: logit descending, equal logits by ascending id, over the full vocab;
    the values are those ids' fp32 log-probs."""
    x = logits.float()
    ids = torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.log_softmax(x, dim=-1).gather(-1, ids), ids


# ---------------------------------------------------------------------------------------------
# top-K + logsumexp


@pytest.mark.parametrize(
    ("shape", "k", "dtype", "kind"),
    [
        ((1, 2, 700), 20, torch.bfloat16, "randn"),
        ((2, 1, 300), 16, torch.float32, "randn"),
        ((1, 2, 1000), 40, torch.float32, "ties"),
        ((1, 1, 50), 50, torch.float16, "randn"),  # k = V
        ((1, 1, 600), 8, torch.float32, "constant"),  # every value equal: the exact fallback path
        ((1, 1, 600), 3, torch.float32, "masked"),  # half the vocabulary at -inf
    ],
)
def test_topk_log_probs_is_the_stable_order(shape, k, dtype, kind):
    from ddtree_runtime.core.kernels.topk import topk_log_probs

    gen = torch.Generator().manual_seed(k)
    x = torch.randn(shape, generator=gen) * 3
    if kind == "ties":
        x = torch.randint(0, 4, shape, generator=gen).float()
    elif kind == "constant":
        x = torch.zeros(shape)
    elif kind == "masked":
        x[..., ::2] = float("-inf")
    x = x.to(dtype)
    lp, ids = topk_log_probs(x, k)
    want_lp, want_ids = stable_topk(x, k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=2e-6)
    if kind != "constant":  # all-equal logits: torch.topk may pick any k ids
        assert torch.equal(ids, tree.topk_log_probs(x, k)[1])


@pytest.mark.parametrize(
    ("k", "variant", "opts"),
    [
        (16, "planned", {}),
        (64, "planned", {}),
        (300, "planned", {}),
        (16, "small tiles, many chunks", {"tile": 256, "chunk": 512}),  # 40 chunks per row
        (64, "small tiles, many chunks", {"tile": 256, "chunk": 2048}),
        (16, "tight buffer", {"tile": 256, "cap": "min"}),  # the bound rises many times mid-stream
        (100, "tight buffer", {"tile": 256, "cap": "min"}),
        (300, "tight buffer", {"tile": 256, "cap": "min"}),
    ],
)
@pytest.mark.parametrize("kind", ["randn", "ties", "masked"])
def test_topk_streaming_paths(k, variant, opts, kind):
    """Rows long enough that every path runs: mid-stream tightening, many chunks, exact bound."""
    from ddtree_runtime.core.kernels.topk import plan, topk_log_probs

    gen = torch.Generator().manual_seed(k)
    vocab = 20000
    if kind == "ties":  # few distinct values: ties inside the top-K and at its cut
        x = torch.randint(0, 40, (3, vocab), generator=gen).float().to(torch.bfloat16)
    else:
        x = (torch.randn((3, vocab), generator=gen) * 2).to(torch.bfloat16)
        if kind == "masked":
            x[:, ::3] = float("-inf")
            x[1, 5000:] = float("-inf")  # a row whose top-K sits in the first chunks
    opts = dict(opts)
    if opts.get("cap") == "min":
        kc, tile, _ = plan(3, vocab, k, opts["tile"])
        opts["cap"] = 1 << (2 * kc + tile - 1).bit_length()
    lp, ids = topk_log_probs(x, k, **opts)
    want_lp, want_ids = stable_topk(x, k)
    assert torch.equal(ids, want_ids), variant
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=2e-6)


def test_topk_rejects_k_out_of_range():
    from ddtree_runtime.core.kernels.topk import topk_log_probs

    with pytest.raises(ValueError, match="k must be in"):
        topk_log_probs(torch.randn(1, 1, 10), 11)


@pytest.mark.parametrize(("kind", "k"), [("ties", 16), ("masked", 100), ("randn", 300)])
def test_shard_topk_ranks_the_logits_themselves(kind, k):
    """RAW mode (a vocabulary shard under TP): the top-k LOGITS by (logit descending, id
    ascending), the row max and sum of exp(x - max), as the plain path computes them."""
    gen = torch.Generator().manual_seed(k)
    x = (torch.randn((2, 3000), generator=gen) * 2).float()
    if kind == "ties":
        x = torch.randint(0, 30, (2, 3000), generator=gen).float()
    elif kind == "masked":
        x[:, ::3] = float("-inf")
    values, ids, top, total = kernels.shard_topk(x, k)
    order = torch.sort(x, dim=-1, descending=True, stable=True)
    assert torch.equal(ids, order.indices[:, :k]) and torch.equal(values, order.values[:, :k])
    assert torch.equal(top, x.max(-1).values)
    # Against the fp64 sum, not another fp32 one: the kernel sums each tile by a tree and the tiles
    # in turn, within ~(log2(tile) + tiles + 2) ulps = ~16 x 6e-8 of the exact sum; torch's fp32
    # sum has its own ~log2(n) ulps, in an order that moves with the CPU's vector width, so two
    # fp32 sums may differ by more than 1e-6 with both correct. 2e-6 is twice the kernel's bound; a
    # lost tile or a wrong rescale is off by percents.
    exact = torch.exp((x - top[:, None]).double()).sum(-1)
    torch.testing.assert_close(total.double(), exact, rtol=2e-6, atol=0)


def test_sharded_head_with_the_kernel_builds_the_single_rank_tree():
    from ddtree_runtime.core.tp_head import VocabShard, merge, pack, shard_topk

    gen = torch.Generator().manual_seed(5)
    v, budget = 2501, 24
    logits = torch.randint(0, 6, (1, 3, v), generator=gen).float()  # ties across the shard cut
    logits[..., 2490:] += 3.0  # the last shard's 11 ids lead every row
    flat = logits.reshape(-1, v)
    shards = [VocabShard(0, 1280, v), VocabShard(1280, v - 1280, v)]  # real rows, padding after
    bufs = [pack(*shard_topk(flat[:, s.start : s.start + s.num], s, budget, kernel=True)) for s in shards]
    top = merge(torch.cat(bufs), 2, budget).reshape(1, 3)
    assert torch.equal(top.ids, tree.topk_log_probs(logits, budget)[1])
    assert_same(tree.build_tree_from_topk(top, budget), tree.build_tree(logits, budget), "tree")
    assert_same(kernels.build_tree_from_topk(top, budget), tree.build_tree(logits, budget), "kernel tree")


def test_logits_an_ulp_apart_rank_by_logit_on_every_path():
    """The H200 finding of 2026-12-02 (K = 1023, V = 248320: sharded ids != single-rank ids): two
    logits an ulp apart can round to one fp32 log-prob, and whether they do depends on the last bit
    of log(sum), i.e. on the summation order (the kernel's chunks, a TP head's shards). Ranked by the
    rounded log-prob with ties to the lower id, the order, and at the cut the ids, followed that
    bit. Here every pair rounds to one log-prob, the higher logit on the higher id, the cut inside
    the last pair: every path must give the logit order and one tree."""
    from ddtree_runtime.core.kernels.topk import topk_log_probs
    from ddtree_runtime.core.tp_head import VocabShard, merge, pack, shard_topk

    gen = torch.Generator().manual_seed(25)
    v, k, pairs = 2501, 25, 13
    logits = torch.randn((1, 3, v), generator=gen) * 0.1 - 2.0  # the mass: log(sum) ~ 6
    lo = torch.arange(pairs) * 7 + 100  # shard 0
    hi = torch.arange(pairs) * 5 + 1300  # shard 1: higher ids, logits one ulp higher
    base = 0.5 + 0.03 * torch.arange(pairs, dtype=torch.float32)  # ulp 6e-8; the log-prob's 5e-7
    logits[..., lo] = base
    logits[..., hi] = torch.nextafter(base, torch.tensor(float("inf")))
    lp = torch.log_softmax(logits, -1)
    assert (lp[..., lo] == lp[..., hi]).sum() >= pairs, "the pairs must tie as fp32 log-probs"
    want_ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :k]
    assert torch.equal(want_ids[..., -1], hi[0].expand(1, 3)), "the cut between the last pair's ids"

    flat = logits.reshape(-1, v)
    shards = [VocabShard(0, 1280, v), VocabShard(1280, v - 1280, v)]
    got = {"plain": tree.topk_log_probs(logits, k), "kernel": topk_log_probs(logits, k)}
    for kernel in (False, True):
        bufs = [pack(*shard_topk(flat[:, s.start : s.start + s.num], s, k, kernel=kernel)) for s in shards]
        top = merge(torch.cat(bufs), 2, k).reshape(1, 3)
        got[f"sharded kernel={kernel}"] = (top.log_probs, top.ids)
    for name, (lps, ids) in got.items():
        assert torch.equal(ids, want_ids), f"{name}: {ids[0, 0].tolist()} != {want_ids[0, 0].tolist()}"
        assert bool((lps[..., 1:] <= lps[..., :-1]).all()), f"{name}: log-probs must not increase"
    want = tree.build_tree(logits, k)
    assert_same(kernels.build_tree(logits, k), want, "kernel tree")
    assert_same(tree.build_tree_from_topk(top, k), want, "sharded tree")


def test_tp_head_bench_runs_its_checks_on_the_cpu(capsys):
    """scripts/kernels/tp_head_bench.py (run on the H200 as is) at its tiny CPU size: its checks
    pass and it prints the bytes per round at batch 1, 8 and 16 for TP 2."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "kernels" / "tp_head_bench.py"
    spec = importlib.util.spec_from_file_location("tp_head_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--tiny", "--batch", "1", "--k", "8", "--iters", "1"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    sizes = {(r["batch"], r["K"]): r for r in lines if r["bench"] == "tp_head_bytes"}
    assert sizes[(16, 8)]["before_allreduce_bytes"] == 240 * 248320 * 4  # [N, V] fp32, TP 2
    assert sizes[(16, 8)]["after_allgather_bytes"] == 240 * 17 * 4  # [N, 2K + 1] fp32
    case = next(r for r in lines if r["bench"] == "tp_head")
    assert case["trees_equal"] and case["topk_ids_equal"]
    assert lines[-1]["all_checks_pass"] is True


# ---------------------------------------------------------------------------------------------
# tree build


@pytest.mark.parametrize(
    ("b", "horizon", "k", "budget"),
    [(2, 4, 16, 16), (1, 15, 40, 40), (2, 3, 3, 60), (1, 2, 1, 4)],
)
def test_build_matches_reference_heap(b, horizon, k, budget):
    from ddtree_runtime.core.kernels.build import build_from_topk

    gen = torch.Generator().manual_seed(budget)
    lp, ids = tree.topk_log_probs(torch.randn(b, horizon, 50, generator=gen), k)
    tokens, depths, parents, scores, num = build_from_topk(lp, ids, budget)
    for r in range(b):
        want_tok, want_dep, want_par, want_sc = tree._reference_build_tree(
            lp[r].tolist(), ids[r].tolist(), budget
        )
        n = len(want_tok)
        assert tokens[r, :n].tolist() == want_tok
        assert depths[r, :n].tolist() == want_dep
        assert parents[r, : n + 1].tolist() == want_par
        torch.testing.assert_close(scores[r, :n].double(), torch.tensor(want_sc, dtype=torch.float64))
        assert int(num[r]) == n
        # padding when fewer prefixes than the budget exist
        assert (tokens[r, n:] == -1).all() and (parents[r, n + 1 :] == -1).all()
        assert (depths[r, n:] == 0).all() and torch.isinf(scores[r, n:]).all()


def test_build_exact_ties_follow_the_ranks_tuple():
    from ddtree_runtime.core.kernels.build import build_from_topk

    # Equal log-probs everywhere: every tie is decided by the ranks tuple (prefix first).
    lp, ids = tree.topk_log_probs(torch.zeros(1, 4, 8), 8)
    tokens, depths, parents, _, _ = build_from_topk(lp, ids, 30)
    want_tok, want_dep, want_par, _ = tree._reference_build_tree(lp[0].tolist(), ids[0].tolist(), 30)
    assert tokens[0].tolist() == want_tok
    assert depths[0].tolist() == want_dep
    assert parents[0].tolist() == want_par


def test_build_rejects_horizon_beyond_the_kernel():
    from ddtree_runtime.core.kernels.build import build_from_topk

    lp, ids = tree.topk_log_probs(torch.randn(1, 16, 20), 4)
    with pytest.raises(ValueError, match="L <= 15"):
        build_from_topk(lp, ids, 8)


# ---------------------------------------------------------------------------------------------
# the whole round against the plain path


def _round(mod, draft, target, roots, prefix, budget, cap, page_size):
    t = mod.build_tree(draft, budget, topk_cap=cap)
    v = mod.compile_tree(t, roots, prefix)
    w = mod.walk_greedy(t, target)
    c = mod.commit_plan(w, prefix, page_size=page_size)
    return t, v, w, c


@pytest.mark.parametrize(
    ("b", "horizon", "vocab", "budget", "cap", "page_size", "dtype"),
    [
        (2, 4, 300, 16, None, 1, torch.float32),
        (3, 5, 40, 30, 4, 4, torch.bfloat16),
        (1, 3, 6, 50, None, 2, torch.float32),  # budget > vocab, and fewer prefixes than the budget
        (2, 3, 64, 12, None, 16, "ties"),
    ],
)
def test_round_matches_plain_path(b, horizon, vocab, budget, cap, page_size, dtype):
    gen = torch.Generator().manual_seed(vocab + budget)
    if dtype == "ties":
        draft = torch.randint(0, 3, (b, horizon, vocab), generator=gen).float()
        draft[..., :20] += 4  # top-K strictly inside: no ties straddle the K-th place
    else:
        draft = torch.randn(b, horizon, vocab, generator=gen).to(dtype)
    roots = torch.randint(0, vocab, (b,), generator=gen)
    prefix = torch.randint(0, 100, (b,), generator=gen)
    plain_tree = tree.build_tree(draft, budget, topk_cap=cap)
    # Target logits whose argmax follows the tree at most nodes, so the walk goes deep.
    target = torch.randn(b, budget + 1, vocab, generator=gen)
    for r in range(b):
        for node in range(budget + 1):
            kids = (plain_tree.parents[r, 1:] == node).nonzero().flatten()
            if len(kids) and torch.rand((), generator=gen) < 0.85:
                pick = kids[torch.randint(0, len(kids), (), generator=gen)]
                target[r, node, plain_tree.tokens[r, pick]] = 10.0
    got = _round(kernels, draft, target, roots, prefix, budget, cap, page_size)
    want = _round(tree, draft, target, roots, prefix, budget, cap, page_size)
    for name, g, w in zip(("tree", "verify", "walk", "plan"), got, want, strict=True):
        assert_same(g, w, name)
    assert int(got[2].num_accepted.max()) > 1


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize(
    ("b", "horizon", "vocab", "budget"), [(3, 5, 9000, 40), (2, 3, 300, 12), (1, 1, 50, 3)]
)
def test_walk_full_and_lazy_match_plain(b, horizon, vocab, budget, lazy):
    """Both walks (the full argmax, and the per-depth launches that read only visited rows)."""
    from ddtree_runtime.core.kernels.walk import walk_arrays

    gen = torch.Generator().manual_seed(b * 100 + vocab)
    draft = torch.randn(b, horizon, vocab, generator=gen)
    t = tree.build_tree(draft, budget)
    target = torch.randn(b, budget + 1, vocab, generator=gen).to(torch.bfloat16)
    target[0, :, 7] = target[0, :, :].max(-1).values  # argmax ties: the first occurrence wins
    for r in range(b):  # the target follows the tree at most rows: deep walks
        for node in range(budget + 1):
            kids = (t.parents[r, 1:] == node).nonzero().flatten()
            if len(kids) and torch.rand((), generator=gen) < 0.8:
                target[r, node, t.tokens[r, kids[0]]] = 20.0
    want = tree.walk_greedy(t, target)
    acc, num, bonus, emit, num_emit = walk_arrays(t.tokens, t.parents, horizon, target, lazy=lazy)
    assert torch.equal(acc, want.accepted)
    assert torch.equal(num, want.num_accepted)
    assert torch.equal(bonus, want.bonus)
    assert torch.equal(emit, want.emitted)
    assert torch.equal(num_emit, want.num_emitted)
    if horizon > 1:
        assert int(num.max()) > 1


def test_empty_budget_gives_root_only():
    t = kernels.build_tree(torch.randn(2, 3, 10), 0)
    assert t.tokens.shape == (2, 0) and t.parents.tolist() == [[-1], [-1]]


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="need CUDA tensors"):
        kernels.build_tree(torch.randn(1, 2, 10), 4)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"\[batch, L, V\]"):
        kernels.build_tree(torch.randn(2, 10), 4)
    with pytest.raises(ValueError, match="topk_cap"):
        kernels.build_tree(torch.randn(1, 2, 10), 4, topk_cap=0)
