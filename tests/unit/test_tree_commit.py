"""commit_plan against a direct simulation of a paged KV cache (page sizes 1, 4, 16).

The simulation writes each tree node's K/V (a marker value) at logical position prefix + i through a
random page table, applies the plan in place exactly as the CommitPlan docstring says, and checks
that logical rows prefix..prefix+a-1 hold the accepted nodes in order, the prefix is untouched and
the freed pages are exactly the ones holding nothing below the new length.
"""

from __future__ import annotations

import random

import pytest
import torch

from ddtree_runtime.core.tree import WalkResult, build_tree, commit_plan, walk_posterior

PREFIX_MARK = -1_000_000

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _walks(seed: int, b: int = 6, budget: int = 20, horizon: int = 6, vocab: int = 8):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    t = build_tree(torch.randn(b, horizon, vocab, generator=gen) * 2, budget)
    post = torch.randint(0, vocab, (b, budget + 1), generator=gen)
    for i in range(b):  # follow the tree often so that paths of many lengths occur
        for node in range(budget + 1):
            kids = [c for c in range(1, budget + 1) if int(t.parents[i, c]) == node]
            if kids and rng.random() < 0.85:
                post[i, node] = t.tokens[i, rng.choice(kids) - 1]
    return t, walk_posterior(t, post)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_commit_matches_simulation(page_size: int) -> None:
    moves_seen = copies_seen = 0
    for seed in range(12):
        t, w = _walks(seed)
        rng = random.Random(seed)
        b, rows = t.batch_size, t.budget + 1
        prefix = torch.tensor([rng.randint(0, 40) for _ in range(b)])
        plan = commit_plan(w, prefix, page_size=page_size)
        assert (plan.dst <= plan.src).all()
        for i in range(b):
            plen, a = int(prefix[i]), int(w.num_accepted[i])
            acc = w.accepted[i, :a].tolist()
            n_pages = -(-(plen + rows) // page_size)
            table = rng.sample(range(500), n_pages)  # logical page -> physical page
            pool = torch.full((500 * page_size,), -7, dtype=torch.long)

            def phys(page: int, offset: int, table=table) -> int:
                return table[page] * page_size + offset

            def at(pos: int, table=table) -> int:
                return table[pos // page_size] * page_size + pos % page_size

            for pos in range(plen):
                pool[at(pos)] = PREFIX_MARK - pos
            for node in range(rows):
                pool[at(plen + node)] = 1000 + node
            # apply: copies in increasing k, in place
            for k in range(a):
                assert int(plan.src_loc[i, k]) == plen + acc[k] and int(plan.dst_loc[i, k]) == plen + k
                if plan.copy[i, k]:
                    src = phys(int(plan.src_page[i, k]), int(plan.src_offset[i, k]))
                    dst = phys(int(plan.dst_page[i, k]), int(plan.dst_offset[i, k]))
                    pool[dst] = pool[src]
                else:
                    assert acc[k] == k
            assert int(plan.num_rows[i]) == a and int(plan.new_len[i]) == plen + a
            assert [int(pool[at(plen + k)]) for k in range(a)] == [1000 + n for n in acc]
            assert all(int(pool[at(pos)]) == PREFIX_MARK - pos for pos in range(plen)), "prefix untouched"
            assert (plan.src[i, a:] == -1).all() and (plan.dst[i, a:] == -1).all()
            # freed pages: exactly those whose every position is >= the new length
            free = set(range(int(plan.free_page_start[i]), int(plan.free_page_end[i])))
            want_free = {p for p in range(n_pages) if p * page_size >= plen + a}
            assert free == want_free
            assert int(plan.free_page_end[i]) == n_pages
            # page moves: the distinct cross-page (src, dst) pairs, in copy order
            pairs: list[tuple[int, int]] = []
            for k in range(a):
                pair = (int(plan.src_page[i, k]), int(plan.dst_page[i, k]))
                if plan.copy[i, k] and pair[0] != pair[1] and pair not in pairs:
                    pairs.append(pair)
            got = [tuple(p) for p in plan.page_moves[i].tolist() if p[0] >= 0]
            assert got == pairs
            assert (plan.page_moves[i, len(pairs) :] == -1).all()
            moves_seen += len(pairs)
            copies_seen += int(plan.copy[i].sum())
    assert copies_seen > 0 and moves_seen > 0, "the cases exercise real and cross-page copies"


def test_page_size_one_remap_without_copy() -> None:
    """SGLang's page-1 path: remap req_to_token to the accepted slots, free the others."""
    for seed in range(10):
        t, w = _walks(seed, budget=15)
        rows = t.budget + 1
        prefix = torch.tensor([3, 0, 11, 5, 8, 2])
        plan = commit_plan(w, prefix, page_size=1)
        for i in range(t.batch_size):
            plen, a = int(prefix[i]), int(w.num_accepted[i])
            slots = random.Random(seed * 10 + i).sample(range(1000), plen + rows)  # req_to_token
            kv = {slot: ("tree", pos - plen) for pos, slot in enumerate(slots) if pos >= plen}
            remapped = list(slots)
            for k in range(a):
                remapped[plen + int(plan.dst[i, k])] = slots[plen + int(plan.src[i, k])]
            freed = {slots[plen + r] for r in range(rows) if not plan.keep[i, r]}
            kept = {remapped[plen + k] for k in range(a)}
            assert [kv[remapped[plen + k]] for k in range(a)] == [
                ("tree", n) for n in w.accepted[i, :a].tolist()
            ]
            assert freed.isdisjoint(kept) and freed | kept == {slots[plen + r] for r in range(rows)}
            assert int(plan.keep[i].sum()) == a


def test_commit_plan_rejects_bad_input() -> None:
    hand = WalkResult(
        accepted=torch.tensor([[0, 2, -1]]),
        num_accepted=torch.tensor([2]),
        bonus=torch.tensor([5]),
        emitted=torch.tensor([[9, 5, -1]]),
        num_emitted=torch.tensor([2]),
    )
    with pytest.raises(ValueError, match="tree_rows"):
        commit_plan(hand, torch.tensor([4]))
    plan = commit_plan(hand, torch.tensor([4]), page_size=4, tree_rows=3)
    assert plan.src[0].tolist() == [0, 2, -1] and plan.dst[0].tolist() == [0, 1, -1]
    assert plan.copy[0].tolist() == [False, True, False]
    assert plan.free_page_start.tolist() == [2] and plan.free_page_end.tolist() == [2]
    with pytest.raises(ValueError, match="page_size"):
        commit_plan(hand, torch.tensor([4]), page_size=0, tree_rows=3)
