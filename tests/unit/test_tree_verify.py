"""compile_tree, verify_attention_mask, the greedy walk (ddtree-algorithm.md section 7 items 4-6, 9)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from ddtree_runtime.core.tree import (
    DraftTree,
    build_tree,
    compile_tree,
    verify_attention_mask,
    walk_greedy,
    walk_posterior,
)

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _tree(seed: int, b: int = 3, horizon: int = 5, vocab: int = 12, budget: int = 14, cap=None) -> DraftTree:
    gen = torch.Generator().manual_seed(seed)
    return build_tree(torch.randn(b, horizon, vocab, generator=gen) * 2, budget, topk_cap=cap)


def _ancestors_or_self(parents: list[int], i: int) -> set[int]:
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


# ---------------------------------------------------------------------------------------------
# compile


def test_compile_mixed_prefix_lengths() -> None:
    t = _tree(0)
    roots = torch.tensor([101, 102, 103])
    prefix = torch.tensor([0, 17, 5])
    v = compile_tree(t, roots, prefix)
    rows = t.budget + 1
    assert v.input_ids[:, 0].tolist() == roots.tolist()
    assert torch.equal(v.input_ids[:, 1:], t.tokens)
    assert v.positions[:, 0].tolist() == prefix.tolist()
    assert torch.equal(v.positions[:, 1:], prefix[:, None] + t.depths)
    assert torch.equal(v.retrieve_index, torch.arange(3 * rows).reshape(3, rows))
    for i in range(3):
        parents = t.parents[i].tolist()
        # siblings share a position
        for a in range(1, rows):
            for c in range(1, rows):
                if parents[a] == parents[c]:
                    assert v.positions[i, a] == v.positions[i, c]
        # each request alone compiles to the same rows
        single = DraftTree(
            t.tokens[i : i + 1], t.depths[i : i + 1], t.parents[i : i + 1], t.scores[i : i + 1],
            t.num_nodes[i : i + 1], t.horizon,
        )  # fmt: skip
        alone = compile_tree(single, roots[i : i + 1], prefix[i : i + 1])
        for name in ("input_ids", "positions", "visibility", "retrieve_next_token", "retrieve_next_sibling"):
            assert torch.equal(getattr(alone, name)[0], getattr(v, name)[i]), name


def test_visibility_is_ancestor_or_self() -> None:
    for seed in range(5):
        t = _tree(seed, budget=20, horizon=6)
        v = compile_tree(t, torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
        for i in range(3):
            parents = t.parents[i].tolist()
            vis = v.visibility[i]
            assert vis[0].tolist() == [True] + [False] * t.budget, "row 0 = {0}"
            assert not torch.triu(vis, diagonal=1).any(), "lower-triangular"
            for row in range(t.budget + 1):
                want = _ancestors_or_self(parents, row)
                assert {j for j in range(t.budget + 1) if vis[row, j]} == want


def test_retrieve_links_enumerate_children_in_pop_order() -> None:
    t = _tree(3, budget=25)
    v = compile_tree(t, torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    for i in range(3):
        parents = t.parents[i].tolist()
        for node in range(t.budget + 1):
            children = [c for c in range(1, t.budget + 1) if parents[c] == node]
            walked, c = [], int(v.retrieve_next_token[i, node])
            while c != -1:
                walked.append(c)
                c = int(v.retrieve_next_sibling[i, c])
            assert walked == children
        assert int(v.retrieve_next_sibling[i, 0]) == -1


def test_attention_mask_prefix_visible_then_tree() -> None:
    t = _tree(1)
    prefix = torch.tensor([0, 9, 4])
    v = compile_tree(t, torch.zeros(3, dtype=torch.long), prefix)
    masks = verify_attention_mask(v, prefix)
    rows = t.budget + 1
    for i, plen in enumerate(prefix.tolist()):
        m = masks[i]
        assert m.shape == (rows, plen + rows) and m.dtype == torch.bool
        assert m[:, :plen].all(), "prefix columns all visible"
        assert torch.equal(m[:, plen:], v.visibility[i])


def test_padded_nodes_are_isolated() -> None:
    # topk_cap=1 with B > L: nodes past the chain are padding.
    t = _tree(2, horizon=3, budget=6, cap=1)
    assert t.num_nodes.tolist() == [3, 3, 3]
    v = compile_tree(t, torch.tensor([7, 7, 7]), torch.tensor([5, 5, 5]))
    assert (v.input_ids[:, 4:] == 0).all(), "padding gets a valid embedding id"
    assert (v.retrieve_next_token[:, 3:] == -1).all()
    assert (v.visibility[:, 4:, :4] == False).all()  # noqa: E712
    assert (v.visibility[:, :4, 4:] == False).all()  # noqa: E712


# ---------------------------------------------------------------------------------------------
# walk (greedy)


def _reference_walk(tree: DraftTree, i: int, posterior: list[int]) -> tuple[list[int], int]:
    """follow_verified_tree of the reference: child maps from parents/tokens, then the loop."""
    n = int(tree.num_nodes[i])
    child_maps: list[dict[int, int]] = [{} for _ in range(tree.budget + 1)]
    for node in range(1, n + 1):
        child_maps[int(tree.parents[i, node])][int(tree.tokens[i, node - 1])] = node
    acc, cur = [0], 0
    while posterior[cur] in child_maps[cur]:
        cur = child_maps[cur][posterior[cur]]
        acc.append(cur)
    return acc, posterior[cur]


def _posterior_following_tree(tree: DraftTree, rng: random.Random, vocab: int, follow: float) -> torch.Tensor:
    """Per node: one of its children's tokens with probability `follow`, else a random token."""
    b, rows = tree.batch_size, tree.budget + 1
    post = torch.zeros(b, rows, dtype=torch.long)
    for i in range(b):
        for node in range(rows):
            kids = [int(tree.tokens[i, c - 1]) for c in range(1, rows) if int(tree.parents[i, c]) == node]
            post[i, node] = rng.choice(kids) if kids and rng.random() < follow else rng.randrange(vocab)
    return post


def test_walk_matches_reference_and_properties() -> None:
    rng = random.Random(5)
    for seed in range(30):
        vocab = rng.randint(3, 30)
        t = _tree(seed, b=4, horizon=rng.randint(1, 7), vocab=vocab, budget=rng.randint(0, 30))
        post = _posterior_following_tree(t, rng, vocab, follow=rng.choice([0.5, 0.9, 1.0]))
        w = walk_posterior(t, post)
        for i in range(4):
            acc, bonus = _reference_walk(t, i, post[i].tolist())
            k = int(w.num_accepted[i])
            assert w.accepted[i, :k].tolist() == acc and (w.accepted[i, k:] == -1).all()
            assert int(w.bonus[i]) == bonus == int(post[i, acc[-1]])
            assert k <= t.horizon + 1 and int(w.num_emitted[i]) == k
            assert all(int(t.parents[i, acc[j + 1]]) == acc[j] for j in range(k - 1)), "parent -> child"
            assert all(a < b for a, b in itertools.pairwise(acc)), "strictly increasing"
            tokens = [int(t.tokens[i, a - 1]) for a in acc[1:]]
            assert w.emitted[i, :k].tolist() == [*tokens, bonus] and (w.emitted[i, k:] == -1).all()
        assert w.tree_rows == t.budget + 1


def test_walk_greedy_uses_target_argmax() -> None:
    t = _tree(4, b=2, vocab=9, budget=10)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 11, 9, generator=gen)
    # make the target agree with node 1 at the root, so something is accepted
    logits[:, 0, :] -= 10
    logits[torch.arange(2), 0, t.tokens[:, 0]] += 20
    w = walk_greedy(t, logits)
    assert (w.num_accepted >= 2).all() and w.accepted[:, 1].tolist() == [1, 1]
    assert torch.equal(w.accepted, walk_posterior(t, logits.argmax(-1)).accepted)
    with pytest.raises(ValueError, match="one row per tree node"):
        walk_greedy(t, logits[:, :5])


def test_chain_tree_walk_equals_dflash_chain_verify() -> None:
    """topk_cap=1: tokens and tau identical to DFlash's chain verify (accept while equal, cumprod)."""
    rng = random.Random(8)
    horizon, vocab = 6, 10
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        draft = torch.randn(5, horizon, vocab, generator=gen)
        t = build_tree(draft, horizon, topk_cap=1)
        chain = draft.argmax(-1)  # DFlash block: [bonus, argmax per depth]
        predict = torch.randint(0, vocab, (5, horizon + 1), generator=gen)
        # target agrees for a random prefix of the chain
        for i in range(5):
            agree = rng.randint(0, horizon)
            predict[i, :agree] = chain[i, :agree]
        correct = (chain == predict[:, :-1]).long().cumprod(dim=1).sum(dim=1)
        bonus = predict[torch.arange(5), correct]
        w = walk_posterior(t, predict)  # node i of the chain is row i of the DFlash block
        assert torch.equal(w.num_accepted, correct + 1), "tau = accepted drafts + 1"
        assert torch.equal(w.bonus, bonus)
        for i in range(5):
            k = int(correct[i])
            assert w.emitted[i, : k + 1].tolist() == [*chain[i, :k].tolist(), int(bonus[i])]


def test_root_only_tree_walk_emits_bonus() -> None:
    t = build_tree(torch.randn(2, 4, 10), 0)
    w = walk_greedy(t, torch.randn(2, 1, 10))
    assert w.num_accepted.tolist() == [1, 1] and w.accepted[:, 0].tolist() == [0, 0]
    assert w.emitted[:, 0].tolist() == w.bonus.tolist()
