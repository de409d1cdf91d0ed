"""T > 0: the lossless walk keeps the target's distribution; a min(1, p/q) rejection variant does not.

ddtree-algorithm.md section 7 item 13 on a toy target: the first two generated tokens of 2e5 rounds
(when a round emits one token, the next round's first token is a target sample at the new root,
drawn here directly) are compared with the target's joint p1(x1) p2(x2 | x1) by a chi-square test.
"""

from __future__ import annotations

import pytest
import torch

from ddtree_runtime.core.tree import DraftTree, build_tree, walk_sample

N = 200_000
V = 4
P1 = torch.tensor([0.4, 0.3, 0.2, 0.1])
P2 = torch.tensor(  # target p(x2 | x1), one row per x1
    [[0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1], [0.05, 0.15, 0.3, 0.5]]
)
Q = torch.tensor([[0.7, 0.2, 0.05, 0.05], [0.5, 0.3, 0.15, 0.05]])  # draft marginals, depths 1..2

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _toy_tree() -> DraftTree:
    """The same tree for all N rounds (built once, broadcast over the batch)."""
    one = build_tree(Q.log().unsqueeze(0), 5)
    return DraftTree(
        *(
            x.expand(N, *x.shape[1:])
            for x in (one.tokens, one.depths, one.parents, one.scores, one.num_nodes)
        ),
        horizon=one.horizon,
    )


def _target_probs(t: DraftTree) -> torch.Tensor:
    """Row 0: p1; a depth-1 node holding a: p2(. | a); deeper rows: uniform (only bonuses come from them)."""
    rows = t.budget + 1
    probs = torch.full((rows, V), 1.0 / V)
    probs[0] = P1
    for node in range(1, rows):
        if int(t.depths[0, node - 1]) == 1:
            probs[node] = P2[int(t.tokens[0, node - 1])]
    return probs.unsqueeze(0).expand(N, rows, V).contiguous()


def _first_two(
    emitted: torch.Tensor, num: torch.Tensor, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    x1 = emitted[:, 0]
    next_round = torch.multinomial(P2[x1], 1, generator=gen).squeeze(1)
    x2 = torch.where(num >= 2, emitted[:, 1], next_round)
    return x1, x2


def _chi_square_pvalue(x1: torch.Tensor, x2: torch.Tensor) -> float:
    observed = torch.bincount(x1 * V + x2, minlength=V * V).double()
    expected = (P1[:, None] * P2).reshape(-1).double() * len(x1)
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = V * V - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def _pq_rejection_walk(
    t: DraftTree, probs: torch.Tensor, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """The WRONG rule: accept child c with min(1, p(c)/q(c)), residual norm(max(p - q, 0)) on reject."""
    rows = t.budget + 1
    parents, tokens, depths = t.parents[0].tolist(), t.tokens[0].tolist(), t.depths[0].tolist()
    cur = torch.zeros(N, dtype=torch.long)
    active = torch.ones(N, dtype=torch.bool)
    emitted = torch.full((N, t.horizon + 1), -1, dtype=torch.long)
    num = torch.zeros(N, dtype=torch.long)
    arange = torch.arange(N)
    for step in range(t.horizon + 1):
        p = probs[arange, cur].clone()
        child = torch.full((N,), -1, dtype=torch.long)
        for node in range(1, rows):
            here = active & (cur == parents[node]) & (child < 0)
            if not here.any():
                continue
            q = Q[depths[node - 1] - 1]
            tok = tokens[node - 1]
            u = torch.rand(N, generator=gen)
            take = here & (u < (p[:, tok] / q[tok]).clamp(max=1))
            child[take] = node
            rej = here & ~take
            residual = (p[rej] - q).clamp(min=0)
            p[rej] = residual / residual.sum(-1, keepdim=True)
        moved = active & (child >= 0)
        stop = active & ~moved
        bonus = torch.multinomial(p[stop], 1, generator=gen).squeeze(1)
        emitted[stop, step] = bonus
        num[stop] = step + 1
        toks = torch.tensor([-1, *tokens])[child.clamp(min=0)]
        emitted[moved, step] = toks[moved]
        cur = torch.where(moved, child, cur)
        active = moved
        if not active.any():
            break
    return emitted, num


def test_lossless_walk_matches_target_distribution() -> None:
    t = _toy_tree()
    probs = _target_probs(t)
    gen = torch.Generator().manual_seed(1)
    w = walk_sample(t, probs, generator=gen)
    x1, x2 = _first_two(w.emitted, w.num_emitted, gen)
    p = _chi_square_pvalue(x1, x2)
    assert p > 1e-3, f"lossless walk rejected by chi-square (p = {p:.3g})"
    # per-node acceptance = sum of the target's probability of the node's children
    root_children = [int(t.tokens[0, c - 1]) for c in range(1, t.budget + 1) if int(t.parents[0, c]) == 0]
    accept_rate = float((w.num_accepted >= 2).double().mean())
    assert abs(accept_rate - float(P1[root_children].sum())) < 0.006
    # the tree actually accepts beyond depth 1 sometimes, so x2 is exercised through the tree
    assert int((w.num_accepted == 3).sum()) > N // 20


def test_pq_rejection_variant_fails_the_same_test() -> None:
    t = _toy_tree()
    gen = torch.Generator().manual_seed(1)
    emitted, num = _pq_rejection_walk(t, _target_probs(t), gen)
    x1, x2 = _first_two(emitted, num, gen)
    p = _chi_square_pvalue(x1, x2)
    assert p < 1e-12, f"the p/q rule should be caught (p = {p:.3g})"


def test_walk_sample_is_reproducible_with_a_generator() -> None:
    t = build_tree(torch.randn(8, 3, 6, generator=torch.Generator().manual_seed(0)), 7)
    probs = torch.softmax(torch.randn(8, 8, 6, generator=torch.Generator().manual_seed(1)), -1)
    a = walk_sample(t, probs, generator=torch.Generator().manual_seed(5))
    b = walk_sample(t, probs, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a.accepted, b.accepted) and torch.equal(a.emitted, b.emitted)
