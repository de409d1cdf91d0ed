"""At T = 0 an exact tie of the target's logits goes to the smallest id, as SGLang's greedy sampler
(``torch.argmax``) resolves it, on every path where DDTREE picks the target's token: the plain walk,
the plugin's round walk (all greedy, and greedy rows next to sampled ones), the plugin's step accept,
the vocabulary-parallel argmax, and the Triton walk kernels (in Triton's interpreter here; the CUDA
twin is tests/gpu/test_greedy_tie_rule_gpu.py, SGLang's own sampler tests/sglang/test_greedy_tie_rule.py).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from ddtree_runtime.core.tree import build_tree, walk_greedy
from ddtree_runtime.sglang_plugin.round.tree_round import walk_round
from ddtree_runtime.sglang_plugin.round.tree_step import accept_greedy, combine_shard_argmax
from tests._ties import NEAR_TIE_LOGPROB_GAP, judge_greedy, sglang_greedy, tied_round

# Ties inside one Triton tile, and across tiles / split-V chunks (the kernels tile V by 4096).
CASES = [(320, 7, 301), (5000, 7, 4500)]


def _plan(tree):
    rows = torch.zeros(tree.batch_size, tree.budget + 1, dtype=torch.long)
    return SimpleNamespace(tree=tree, candidates=rows)


def _check(walk, case, budget: int) -> None:
    want = int(sglang_greedy(case.target_logits[0, 0]))
    assert want == case.lo
    if budget == 1:  # the tree holds hi only: rejected, the tie's winner is the bonus
        assert walk.num_accepted.tolist() == [1] and walk.emitted[0, 0].item() == case.lo
    else:  # the tree holds both: the node holding lo is accepted, then lo again (every row ties)
        assert walk.num_accepted.tolist() == [2]
        assert walk.emitted[0, :2].tolist() == [case.lo, case.lo]


@pytest.mark.parametrize("budget", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("vocab", "lo", "hi"), CASES)
def test_an_exact_tie_goes_to_the_smallest_id_on_every_cpu_path(vocab, lo, hi, dtype, budget):
    case = tied_round(vocab, lo, hi, dtype=dtype)
    tree = build_tree(case.draft_logits, budget)
    assert sorted(tree.tokens[0].tolist()) == sorted([hi, lo][:budget])
    logits = case.target_logits[:, : budget + 1]
    _check(walk_greedy(tree, logits), case, budget)
    _check(walk_round(_plan(tree), logits, None), case, budget)
    _check(walk_round(_plan(tree), logits, torch.zeros(1)), case, budget)
    _check(accept_greedy(_plan(tree), logits.reshape(budget + 1, vocab)).walk, case, budget)


def test_greedy_rows_next_to_sampled_ones_take_the_smallest_tied_id():
    case = tied_round(320, 7, 301)
    tree = build_tree(case.draft_logits.expand(2, -1, -1).contiguous(), 1)
    logits = case.target_logits[:, :2].expand(2, -1, -1).contiguous()
    temps, gen = torch.tensor([0.0, 1.0]), torch.Generator().manual_seed(0)
    walk = walk_round(_plan(tree), logits, temps, generator=gen)
    assert walk.num_accepted[0].item() == 1 and walk.emitted[0, 0].item() == case.lo


def test_the_vocabulary_parallel_argmax_takes_the_smallest_global_id():
    # Two shards, each holding one of the tied ids: the global argmax is the smaller id.
    shard_max = torch.tensor([[5.0, 5.0], [5.0, 4.0]])
    shard_ids = torch.tensor([[301, 12], [7, 200]])
    assert combine_shard_argmax(shard_max, shard_ids).tolist() == [7, 12]


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton's interpreter: TRITON_INTERPRET=1 before triton is imported, no CUDA")
@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize(("vocab", "lo", "hi"), CASES)
def test_the_walk_kernels_take_the_smallest_tied_id(vocab, lo, hi, lazy):
    from ddtree_runtime.core.kernels.walk import walk_arrays

    for budget in (1, 2):
        case = tied_round(vocab, lo, hi)
        tree = build_tree(case.draft_logits, budget)
        _, num, _, emit, _ = walk_arrays(tree.tokens, tree.parents, tree.horizon,
                                         case.target_logits[:, : budget + 1].contiguous(), lazy=lazy)
        _check(SimpleNamespace(num_accepted=num, emitted=emit), case, budget)


# ---------------------------------------------------------------------------- the identity tests' judge


def _doc(ids, top):
    return {"output_ids": ids, "meta_info": {"output_top_logprobs": top}}


def test_identity_judge_accepts_only_a_first_difference_at_a_near_tie_and_counts_it():
    tie = [[-0.8069, 286, None], [-0.8069, 301, None]]
    wide = [[-0.1, 286, None], [-2.5, 301, None]]
    plain = [_doc([1, 286, 3], [wide, tie, wide]), _doc([1, 286, 3], [wide, wide, wide]),
             _doc([5, 6], [wide, wide])]
    verdict = judge_greedy(plain, [[1, 301, 9], [1, 301, 3], [5, 6]], ["a", "b", "c"])
    assert verdict.identical == 1 and [t["prompt"] for t in verdict.near_ties] == ["a"]
    assert [f["prompt"] for f in verdict.failures] == ["b"] and not verdict.ok
    assert verdict.figures()["near_ties"] == 1 and verdict.figures()["near_tie_bound"] == NEAR_TIE_LOGPROB_GAP
    # a near-tie the other answer did not take (a third token) is no excuse
    assert not judge_greedy([_doc([1, 286], [wide, tie])], [[1, 17]]).ok
    # no log-probs from the plain server: nothing to excuse a difference with
    assert not judge_greedy([{"output_ids": [1, 2], "meta_info": {}}], [[1, 3]]).ok
