"""The tree step's SGLang-layout pieces: hidden gather by node index, KV window commit, greedy
over a vocabulary-parallel head (a real 2-rank gloo group)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddtree_runtime.sglang_plugin.round.tree_step import (
    accept_from_posterior,
    accept_greedy,
    combine_shard_argmax,
    draft_position_logits,
    gather_accepted_hidden,
    greedy_global_ids,
    plan_tree_verify,
    window_permutation,
)

pytestmark = pytest.mark.sglang


def _plan(seed=0, b=3, horizon=5, vocab=13, budget=9, topk_cap=None):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, horizon, vocab, generator=g) * 2
    return plan_tree_verify(
        logits, torch.arange(b), torch.tensor([4, 9, 1][:b]), budget, topk_cap=topk_cap
    )


def _follow(plan, r, nodes):
    """Target tokens that accept the given node path of request r, then stop."""
    b, rows = plan.candidates.shape
    post = torch.full((b, rows), -5, dtype=torch.long)  # -5 matches no token
    cur = 0
    for n in nodes:
        assert int(plan.tree.parents[r, n]) == cur
        post[r, cur] = plan.candidates[r, n]
        cur = n
    post[r, cur] = 77  # the bonus
    return post


def test_verify_layout_matches_sglangs_conventions():
    plan = _plan()
    b, rows = plan.candidates.shape
    assert rows == 10 and plan.draft_token_num == 10
    assert torch.equal(plan.candidates[:, 0], torch.arange(b))  # root = previous bonus
    assert torch.equal(plan.retrieve_index, torch.arange(b * rows).view(b, rows))
    prefix = [4, 9, 1]
    assert plan.custom_mask.numel() == sum(rows * (p + rows) for p in prefix)
    # request 1's block: prefix columns all visible, tree part = ancestor-or-self
    off = rows * (prefix[0] + rows)
    m1 = plan.custom_mask[off: off + rows * (prefix[1] + rows)].view(rows, prefix[1] + rows)
    assert bool(m1[:, : prefix[1]].all())
    tree = m1[:, prefix[1]:]
    for i in range(rows):
        anc, cur = {i}, i
        while cur > 0:
            cur = int(plan.tree.parents[1, cur])
            anc.add(cur)
        assert {j for j in range(rows) if tree[i, j]} == anc
    # positions: prefix + depth
    depths = torch.cat([torch.zeros(b, 1, dtype=torch.long), plan.tree.depths], 1)
    assert torch.equal(plan.positions.view(b, rows), torch.tensor(prefix).unsqueeze(1) + depths)


def test_draft_position_logits_drops_the_bonus_slot():
    block = torch.arange(2 * 4 * 3, dtype=torch.float32).view(8, 3)
    per_depth = draft_position_logits(block, 2)
    assert per_depth.shape == (2, 3, 3)
    assert torch.equal(per_depth[1, 0], block[5])
    with pytest.raises(ValueError, match=r"\[batch \* block, V\]"):
        draft_position_logits(block, 3)


def test_hidden_states_are_gathered_by_node_index_not_prefix():
    plan = _plan(budget=9)
    r = 1
    # a path through a non-first child: pick the deepest node whose path is not 0,1,2,...
    deep = max(range(1, 10), key=lambda n: (int(plan.tree.depths[r, n - 1]), n))
    path, cur = [], deep
    while cur > 0:
        path.append(cur)
        cur = int(plan.tree.parents[r, cur])
    path.reverse()
    accept = accept_from_posterior(plan, _follow(plan, r, path))
    assert accept.walk.accepted[r, : len(path) + 1].tolist() == [0, *path]
    rows = plan.draft_token_num
    hidden = torch.arange(3 * rows, dtype=torch.float32).unsqueeze(1).repeat(1, 4)  # row id per row
    got = gather_accepted_hidden(hidden, accept)
    want = [0 * rows, 1 * rows + 0, *[1 * rows + n for n in path], 2 * rows]
    assert got[:, 0].long().tolist() == want
    assert path != list(range(1, len(path) + 1)), "the test needs a non-prefix path"


def test_window_permutation_commits_accepted_rows_first_and_keeps_every_slot():
    plan = _plan(budget=9)
    post = _follow(plan, 0, [1])
    accept = accept_from_posterior(plan, post)
    window = 16
    perm = window_permutation(accept, window)
    for r in range(perm.shape[0]):
        acc = [int(x) for x in accept.walk.accepted[r] if x >= 0]
        assert perm[r, : len(acc)].tolist() == acc
        assert sorted(perm[r].tolist()) == list(range(window))  # nothing lost, nothing doubled
        rest = perm[r, len(acc):].tolist()
        assert rest == sorted(rest)
    # applied to req_to_token: logical position k now holds the slot of accepted row acc[k]
    slots = torch.arange(100, 100 + window)
    assert slots[perm[0]][:2].tolist() == [100, 101]


def test_accept_greedy_uses_the_target_argmax():
    plan = _plan(b=1)
    rows, vocab = plan.draft_token_num, 13
    logits = torch.zeros(rows, vocab)
    first_child = int(plan.retrieve_next_token[0, 0])
    logits[0, int(plan.candidates[0, first_child])] = 5.0
    logits[first_child, 3] = 5.0
    accept = accept_greedy(plan, logits)
    assert accept.walk.accepted[0, :2].tolist() == [0, first_child]
    assert accept.accept_length.tolist() == [int(accept.walk.num_accepted[0]) - 1]


def test_combine_shard_argmax_prefers_the_lowest_global_id_on_ties():
    maxes = torch.tensor([[1.0, 5.0, 2.0], [3.0, 5.0, 2.0]])
    ids = torch.tensor([[4, 1, 0], [12, 10, 11]])
    assert combine_shard_argmax(maxes, ids).tolist() == [12, 1, 0]


def _tp_worker(rank: int, world: int, init_file: str, logits: torch.Tensor, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    shard = logits.shape[-1] // world
    local = logits[:, rank * shard: (rank + 1) * shard]
    out[rank] = greedy_global_ids(local, rank * shard, group=dist.group.WORLD).tolist()
    dist.destroy_process_group()


def test_greedy_over_a_vocab_parallel_head_yields_global_ids(tmp_path):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 20, generator=g)
    logits[0, 17] = 50.0  # a winner in the second shard: its local index (7) is a different token
    logits[1, 2] = 50.0
    manager = mp.Manager()
    out = manager.dict()
    init_file = str(tmp_path / "pg")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_tp_worker, args=(2, init_file, logits, out), nprocs=2, join=True)
    want = logits.argmax(dim=-1).tolist()
    assert out[0] == want and out[1] == want
    assert want[0] == 17
