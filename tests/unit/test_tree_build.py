"""build_tree: budget, order, reference-heap parity, brute-force optimality, chain degeneracy, dispatch.

ddtree-algorithm.md section 7 items 1-4 (and the reference parity of item 7 against the literal heap).
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from ddtree_runtime.core import kernels
from ddtree_runtime.core import tree as tree_mod
from ddtree_runtime.core.tree import _reference_build_tree, build_tree, topk_log_probs

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _reference(logits: torch.Tensor, budget: int, topk_cap: int | None = None):
    """Per request: the literal heap over the same per-depth top-K."""
    vocab = logits.shape[2]
    k = min(budget, vocab, topk_cap or budget)
    lp, ids = topk_log_probs(logits, k)
    return [_reference_build_tree(lp[i].tolist(), ids[i].tolist(), budget) for i in range(logits.shape[0])]


def _random_logits(rng: random.Random, b: int, horizon: int, vocab: int, tied: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    if tied:  # quantised logits: many exactly equal log-probs and scores
        return torch.randint(0, rng.choice([2, 3, 4]), (b, horizon, vocab), generator=gen).float()
    return torch.randn(b, horizon, vocab, generator=gen) * rng.choice([0.5, 2.0, 5.0])


def _assert_matches_reference(t, logits, budget, topk_cap=None):
    for i, (tokens, depths, parents, scores) in enumerate(_reference(logits, budget, topk_cap)):
        n = len(tokens)
        assert int(t.num_nodes[i]) == n
        assert t.tokens[i, :n].tolist() == tokens
        assert t.depths[i, :n].tolist() == depths
        assert t.parents[i, : n + 1].tolist() == parents
        assert torch.allclose(t.scores[i, :n].double(), torch.tensor(scores, dtype=torch.float64), atol=1e-5)
        # padding past the real nodes
        assert (t.depths[i, n:] == 0).all() and (t.parents[i, n + 1 :] == -1).all()
        assert (t.tokens[i, n:] == -1).all()


# ---------------------------------------------------------------------------------------------
# Parity with the literal heap (node order = pop order, tie-break included)


@pytest.mark.parametrize("tied", [False, True], ids=["random", "tied"])
def test_batched_build_equals_reference_heap(tied: bool) -> None:
    rng = random.Random(1234 + tied)
    for _ in range(150):
        b, horizon, vocab = rng.randint(1, 4), rng.randint(1, 6), rng.randint(1, 9)
        budget = rng.randint(0, 24)
        cap = rng.choice([None, None, 1, 2, 3])
        logits = _random_logits(rng, b, horizon, vocab, tied)
        t = build_tree(logits, budget, topk_cap=cap)
        assert t.tokens.shape == (b, budget) and t.parents.shape == (b, budget + 1)
        if budget:
            _assert_matches_reference(t, logits, budget, cap)


def test_larger_trees_equal_reference_heap() -> None:
    rng = random.Random(7)
    for tied in (False, True):
        for budget, vocab in ((16, 300), (64, 300), (130, 300), (300, 40), (200, 3)):
            logits = _random_logits(rng, 3, 15, vocab, tied)
            _assert_matches_reference(build_tree(logits, budget), logits, budget)


def test_all_equal_logits_order_by_ranks_tuple() -> None:
    # Every score at a depth ties: order is purely the ranks tuple, shorter prefix first.
    t = build_tree(torch.zeros(1, 2, 2), 6)
    # log(1/2) per depth: four... depth-1 nodes score -0.69, depth-2 -1.39
    assert t.depths[0].tolist() == [1, 1, 2, 2, 2, 2]
    assert t.parents[0].tolist() == [-1, 0, 0, 1, 1, 2, 2]
    assert t.tokens[0].tolist() == [0, 1, 0, 1, 0, 1]  # equal log-probs rank by token id


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_any_float_dtype_scores_in_fp32(dtype: torch.dtype) -> None:
    logits = torch.randn(2, 4, 50, generator=torch.Generator().manual_seed(3)).to(dtype)
    t = build_tree(logits, 20)
    assert t.scores.dtype == torch.float32
    _assert_matches_reference(t, logits, 20)
    # score = sum of fp32 log-softmax over the FULL vocabulary along the root path
    lp = torch.log_softmax(logits.float(), -1).double()
    for i in range(2):
        for n in range(20):
            node, total = n + 1, 0.0
            while node > 0:
                total += float(lp[i, t.depths[i, node - 1] - 1, t.tokens[i, node - 1]])
                node = int(t.parents[i, node])
            assert math.isclose(total, float(t.scores[i, n]), rel_tol=1e-5, abs_tol=1e-5)


# ---------------------------------------------------------------------------------------------
# Item 1: budget


def test_exactly_budget_nodes_when_vocab_at_least_budget() -> None:
    logits = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(0))
    for budget in (1, 2, 5, 17, 40):
        t = build_tree(logits, budget)
        assert t.num_nodes.tolist() == [budget] * 3
        assert (t.depths >= 1).all()


def test_budget_zero_is_root_only() -> None:
    t = build_tree(torch.randn(2, 5, 10), 0)
    assert t.tokens.shape == (2, 0) and t.parents.tolist() == [[-1], [-1]]
    assert t.num_nodes.tolist() == [0, 0]


def test_budget_one_is_depth1_argmax() -> None:
    logits = torch.randn(4, 6, 30, generator=torch.Generator().manual_seed(5))
    t = build_tree(logits, 1)
    assert t.tokens[:, 0].tolist() == logits[:, 0].argmax(-1).tolist()
    assert t.depths.tolist() == [[1]] * 4 and t.parents.tolist() == [[-1, 0]] * 4


def test_zero_horizon_is_root_only() -> None:
    t = build_tree(torch.randn(1, 0, 10), 4)
    assert t.num_nodes.tolist() == [0] and t.horizon == 0


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match=r"\[batch, L, V\]"):
        build_tree(torch.randn(5, 10), 4)
    with pytest.raises(ValueError, match="float"):
        build_tree(torch.ones(1, 2, 3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="topk_cap"):
        build_tree(torch.randn(1, 2, 3), 4, topk_cap=0)


# ---------------------------------------------------------------------------------------------
# Item 2: order and structure


def test_structure_properties() -> None:
    rng = random.Random(99)
    for _ in range(40):
        b, horizon, vocab, budget = (
            rng.randint(1, 3),
            rng.randint(1, 8),
            rng.randint(2, 40),
            rng.randint(1, 40),
        )
        t = build_tree(_random_logits(rng, b, horizon, vocab, rng.random() < 0.5), budget)
        for i in range(b):
            n = int(t.num_nodes[i])
            scores = t.scores[i, :n]
            assert (scores[1:] <= scores[:-1]).all(), "scores non-increasing"
            parents = t.parents[i, 1 : n + 1]
            assert (parents < torch.arange(1, n + 1)).all() and (parents >= 0).all()
            assert (t.depths[i, :n] <= horizon).all()
            parent_depth = torch.cat([torch.zeros(1, dtype=torch.long), t.depths[i, :n]])[parents]
            assert (t.depths[i, :n] == parent_depth + 1).all()
            parent_score = torch.cat([torch.zeros(1), t.scores[i, :n]])[parents]
            assert (scores <= parent_score + 1e-6).all()
            pairs = list(zip(parents.tolist(), t.tokens[i, :n].tolist(), strict=True))
            assert len(set(pairs)) == n, "siblings have distinct tokens"


# ---------------------------------------------------------------------------------------------
# Item 3: brute-force optimality on tiny vocabularies


def _all_prefixes(lp: torch.Tensor):
    """Every prefix (token tuple) with its exact log-prob (fp64 sums of the fp32 log-probs)."""
    horizon, vocab = lp.shape
    out = {}
    for d in range(1, horizon + 1):
        for toks in itertools.product(range(vocab), repeat=d):
            out[toks] = sum(float(lp[j, t]) for j, t in enumerate(toks))
    return out


def _tree_prefixes(t, i: int) -> list[tuple[int, ...]]:
    n = int(t.num_nodes[i])
    paths: list[tuple[int, ...]] = [()]
    for node in range(1, n + 1):
        paths.append((*paths[int(t.parents[i, node])], int(t.tokens[i, node - 1])))
    return paths[1:]


def test_bruteforce_optimality_tiny_vocab() -> None:
    rng = random.Random(2026)
    checked = 0
    for _ in range(60):
        vocab, horizon, budget = rng.randint(2, 6), rng.randint(1, 4), rng.randint(1, 10)
        logits = _random_logits(rng, 1, horizon, vocab, rng.random() < 0.4)
        lp = torch.log_softmax(logits[0].float(), -1)
        # rank of each token per depth: logit descending, token id ascending (the documented order)
        x0 = logits[0].float()
        rank = [
            {tok: r for r, tok in enumerate(sorted(range(vocab), key=lambda x, d=d: (-float(x0[d, x]), x)))}
            for d in range(horizon)
        ]
        prefixes = _all_prefixes(lp)
        key = {p: (-s, tuple(rank[j][x] for j, x in enumerate(p))) for p, s in prefixes.items()}
        expected = sorted(prefixes, key=lambda p: key[p])[:budget]
        t = build_tree(logits, budget)
        got = _tree_prefixes(t, 0)
        assert got == expected, "node set AND order = top-B prefixes under the section-2 key"
        # Optimality: the sum of prefix probabilities is the sum of the B largest prefix
        # probabilities, an upper bound for every prefix-closed tree of size B.
        best = sum(sorted((math.exp(s) for s in prefixes.values()), reverse=True)[:budget])
        assert math.isclose(sum(math.exp(prefixes[p]) for p in got), best, rel_tol=1e-9)
        assert all(p[:-1] in set(got) or len(p) == 1 for p in got), "prefix-closed"
        checked += 1
    assert checked == 60


def test_bruteforce_over_all_prefix_closed_trees() -> None:
    # Exhaustive: every prefix-closed node set of size B, for a few tiny cases.
    gen = torch.Generator().manual_seed(11)
    for vocab, horizon, budget in [(3, 2, 3), (3, 2, 4), (2, 3, 4), (3, 3, 3)]:
        logits = torch.randn(1, horizon, vocab, generator=gen) * 2
        lp = torch.log_softmax(logits[0], -1)
        prefixes = _all_prefixes(lp)
        best = 0.0
        for subset in itertools.combinations(prefixes, budget):
            chosen = set(subset)
            if all(len(p) == 1 or p[:-1] in chosen for p in subset):
                best = max(best, sum(math.exp(prefixes[p]) for p in subset))
        got = _tree_prefixes(build_tree(logits, budget), 0)
        assert math.isclose(sum(math.exp(prefixes[p]) for p in got), best, rel_tol=1e-9)


# ---------------------------------------------------------------------------------------------
# Item 4: chain degeneracy


@pytest.mark.parametrize("budget", [1, 4, 7, 12])
def test_topk_cap_one_is_the_dflash_argmax_chain(budget: int) -> None:
    horizon = 7
    logits = torch.randn(3, horizon, 50, generator=torch.Generator().manual_seed(budget))
    t = build_tree(logits, budget, topk_cap=1)
    n = min(budget, horizon)
    assert t.num_nodes.tolist() == [n] * 3
    assert t.tokens[:, :n].tolist() == logits[:, :n].argmax(-1).tolist()
    assert t.depths[:, :n].tolist() == [list(range(1, n + 1))] * 3
    assert t.parents[:, : n + 1].tolist() == [[-1, *range(n)]] * 3
    assert (t.tokens[:, n:] == -1).all() and (t.parents[:, n + 1 :] == -1).all()


def test_one_hot_marginals_give_the_chain() -> None:
    logits = torch.full((2, 5, 20), -30.0)
    chain = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    logits.scatter_(2, chain.unsqueeze(-1), 30.0)
    t = build_tree(logits, 5)
    assert t.tokens.tolist() == chain.tolist()
    assert t.parents.tolist() == [[-1, 0, 1, 2, 3, 4]] * 2


# ---------------------------------------------------------------------------------------------
# Kernel dispatch


class _FakeCuda:
    """Stands for a [1, 15, 64] CUDA float tensor: dispatch only looks at these attributes."""

    is_cuda = True
    shape = (1, 15, 64)

    def dim(self) -> int:
        return len(self.shape)

    def is_floating_point(self) -> bool:
        return True


def test_dispatch_to_kernels_when_available(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(kernels, "available", lambda: True)
    monkeypatch.setattr(
        kernels, "build_tree", lambda *a, **kw: calls.append((a, kw)) or "kernel-tree", raising=False
    )
    monkeypatch.delenv("DDTREE_DISABLE_KERNELS", raising=False)
    fake = _FakeCuda()
    assert build_tree(fake, 8, topk_cap=2) == "kernel-tree"  # type: ignore[arg-type]
    assert calls == [((fake, 8), {"topk_cap": 2})]
    monkeypatch.setenv("DDTREE_DISABLE_KERNELS", "1")
    assert tree_mod._kernel_for("build_tree", fake) is None
    monkeypatch.delenv("DDTREE_DISABLE_KERNELS")
    monkeypatch.setattr(kernels, "available", lambda: False)
    assert tree_mod._kernel_for("build_tree", fake) is None


def test_cpu_tensors_never_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "available", lambda: True)
    monkeypatch.setattr(
        kernels, "build_tree", lambda *a, **kw: pytest.fail("dispatched a CPU tensor"), raising=False
    )
    t = build_tree(torch.randn(1, 3, 10), 4)
    assert t.num_nodes.tolist() == [4]


# ---------------------------------------------------------------------------------------------
# Masked and broken logits


def test_masked_vocabulary_ranks_last_and_stays_finite_in_order() -> None:
    logits = torch.randn(2, 2, 10, generator=torch.Generator().manual_seed(4))
    logits[:, :, 3:] = float("-inf")  # 3 live tokens per depth: 3 + 9 live prefixes
    t = build_tree(logits, 15)
    assert t.num_nodes.tolist() == [15, 15]
    assert not torch.isnan(t.scores).any()
    live = torch.isfinite(t.scores)
    assert live[:, :12].all() and not live[:, 12:].any(), "the 12 live prefixes first"
    assert (t.tokens[:, :12] < 3).all() and (t.tokens[:, 12:] >= 3).all()
    for i, (tokens, depths, parents, _) in enumerate(_reference(logits[:, :, :3], 12)):
        assert (t.tokens[i, :12].tolist(), t.depths[i, :12].tolist()) == (tokens, depths)
        assert t.parents[i, :13].tolist() == parents, "the live part is the 3-token tree"


def test_nan_logits_are_refused() -> None:
    logits = torch.randn(1, 2, 5)
    logits[0, 1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        build_tree(logits, 4)
