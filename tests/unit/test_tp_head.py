"""The drafter's head under tensor parallelism (``ddtree_runtime.core.tp_head``): each rank ranks its
vocabulary shard, the ranks all-gather ``[N, 2K + 1]`` and merge; the tree built from the merge is
the single-rank tree from the full vocabulary, node for node, on every rank.

Ranks are processes over ``torch.distributed`` gloo (2 and 4 of them); shards follow SGLang's
layout (``tp_head.vocab_shards``: real rows, then padding, a vocabulary not divisible by the TP
size; tests/sglang/test_tp_draft_head.py checks it against SGLang's own and runs SGLang's code).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ddtree_runtime.core import tree
from ddtree_runtime.core.tp_head import (
    MAX_VOCAB,
    VocabShard,
    exchange,
    merge,
    pack,
    shard_topk,
    sharded_topk,
    vocab_shards,
)
from ddtree_runtime.core.tree_types import DraftTopK, topk_width

LARGEST_BUDGET = 1023  # sglang_plugin.cli_args.MAX_BUDGET


def _cases() -> dict[str, tuple[torch.Tensor, int, int | None]]:
    """name -> (logits [b, L, V], budget, topk cap). Deterministic: every process builds the same."""
    g = torch.Generator().manual_seed(25)
    v = 3001
    cases: dict[str, tuple[torch.Tensor, int, int | None]] = {}
    cases["randn"] = (torch.randn(2, 4, v, generator=g) * 3, 64, None)
    # Few distinct values: ties inside the top-K, at its cut and across shards (smallest id wins).
    cases["ties"] = (torch.randint(0, 5, (2, 3, v), generator=g).float(), 16, None)
    cases["largest budget"] = (torch.randn(1, 3, v, generator=g) * 2, LARGEST_BUDGET, None)
    one = torch.randn(1, 4, v, generator=g)
    one[..., v - 700 :] += 12.0  # the last shard holds every candidate the tree can take
    cases["one shard holds the top-K"] = (one, 200, None)
    masked = torch.randn(2, 2, v, generator=g) * 2
    masked[..., 5:] = float("-inf")  # 5 finite ids, fewer than K: real -inf ids fill the list by id
    cases["masked"] = (masked, 12, None)
    dup = torch.randn(1, 3, v, generator=g)
    dup[..., 2900:2940] = dup[..., 10:50] = 9.0  # equal logits at the K-th place, in two shards
    cases["duplicates across shards"] = (dup, 48, None)
    cases["top-k cap"] = (torch.randn(2, 5, v, generator=g) * 3, 20, 3)
    return cases


def _simulated(logits: torch.Tensor, shards: list[VocabShard], k: int) -> DraftTopK:
    """Every rank's packed buffer, gathered by concatenation, merged (one process)."""
    b, horizon, v = logits.shape
    flat = logits.reshape(-1, v)
    bufs = [pack(*shard_topk(flat[:, s.start : s.start + s.num], s, k)) for s in shards]
    return merge(torch.cat(bufs), len(shards), k).reshape(b, horizon)


def assert_same_tree(got: tree.DraftTree, want: tree.DraftTree, what: str) -> None:
    for field in ("tokens", "depths", "parents", "num_nodes"):
        assert torch.equal(getattr(got, field), getattr(want, field)), f"{what}: {field}"
    torch.testing.assert_close(got.scores, want.scores, rtol=0, atol=1e-5, msg=what)


def assert_single_rank_result(top: DraftTopK, logits: torch.Tensor, budget: int, cap: int | None, what: str):
    want_lp, want_ids = tree.topk_log_probs(logits, top.k)
    assert torch.equal(top.ids, want_ids), what
    torch.testing.assert_close(top.log_probs, want_lp, rtol=0, atol=2e-6, msg=what)
    torch.testing.assert_close(top.logsumexp, torch.logsumexp(logits, -1), rtol=0, atol=2e-6, msg=what)
    got = tree.build_tree_from_topk(top, budget, topk_cap=cap)
    assert_same_tree(got, tree.build_tree(logits, budget, topk_cap=cap), what)


# ---------------------------------------------------------------------------------------------
# Ranks as processes over gloo


GROUPS = (4, 2)  # TP sizes, run by one set of 4 processes: all of them, then a group of ranks 0-1


def _rank_main(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=max(GROUPS))
    try:
        for world in GROUPS:
            group = dist.new_group(list(range(world)))  # every process takes part in creating it
            if rank >= world:
                continue
            results = {}
            for name, (logits, budget, cap) in _cases().items():
                b, horizon, v = logits.shape
                shard = vocab_shards(v, world)[rank]
                local = logits.reshape(-1, v)[:, shard.start : shard.start + shard.num]
                top = sharded_topk(
                    local, shard, topk_width(budget, v, cap), world=world,
                    all_gather=lambda out, inp, g=group: dist.all_gather_into_tensor(out, inp, group=g),
                ).reshape(b, horizon)
                results[name] = (top, tree.build_tree_from_topk(top, budget, topk_cap=cap))
            torch.save(results, Path(out_dir) / f"tp{world}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_ranks(tmp_path_factory) -> dict[int, list[dict]]:
    """TP size -> every rank's results, from processes over gloo."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("tp-head")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_rank_main, args=(str(tmp / "pg"), str(tmp)), nprocs=max(GROUPS), join=True)
    return {
        world: [torch.load(tmp / f"tp{world}-rank{r}.pt", weights_only=False) for r in range(world)]
        for world in GROUPS
    }


@pytest.mark.parametrize("world", GROUPS)
def test_every_rank_builds_the_single_rank_tree(world, gloo_ranks, torch_one_thread):
    ranks = gloo_ranks[world]
    for name, (logits, budget, cap) in _cases().items():
        top0, tree0 = ranks[0][name]
        assert_single_rank_result(top0, logits, budget, cap, f"{name}, TP {world}")
        assert_same_tree(tree0, tree.build_tree(logits, budget, topk_cap=cap), name)
        for r in range(1, world):  # the same bytes on every rank: the same tree everywhere
            top, got = ranks[r][name]
            for field in ("log_probs", "ids", "logsumexp"):
                assert torch.equal(getattr(top, field), getattr(top0, field)), (name, r, field)
            assert_same_tree(got, tree0, f"{name}, rank {r}")


# ---------------------------------------------------------------------------------------------
# The merge in one process (the gather simulated by concatenation)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_merge_of_simulated_ranks_is_the_single_rank_result(world, torch_one_thread):
    for name, (logits, budget, cap) in _cases().items():
        v = logits.shape[-1]
        top = _simulated(logits, vocab_shards(v, world), topk_width(budget, v, cap))
        assert_single_rank_result(top, logits, budget, cap, f"{name}, {world} shards")


def test_a_shard_without_real_ids_and_shards_shorter_than_k(torch_one_thread):
    # V = 12 over 4 ranks padded to 64: 16 ids per slice, so ranks 1-3 hold none at all.
    logits = torch.randn(1, 3, 12, generator=torch.Generator().manual_seed(2))
    shards = vocab_shards(12, 4)
    assert [s.num for s in shards] == [12, 0, 0, 0]
    assert_single_rank_result(_simulated(logits, shards, 7), logits, 7, None, "empty shards")
    uneven = [VocabShard(0, 3, 12), VocabShard(3, 1, 12), VocabShard(4, 8, 12)]  # 3 and 1 < K
    assert_single_rank_result(_simulated(logits, uneven, 7), logits, 7, None, "short shards")


def test_padding_candidates_lose_to_real_minus_inf_logits():
    logits = torch.full((1, 1, 6), float("-inf"))
    logits[..., 4] = 0.0
    shards = [VocabShard(0, 2, 6), VocabShard(2, 4, 6)]  # K = 5 > 2: shard 0 pads 3 slots with id 6
    top = _simulated(logits, shards, 5)
    assert top.ids.tolist() == [[[4, 0, 1, 2, 3]]]  # real -inf ids, ascending; never the padding id 6


def test_the_packed_exchange_is_2k_plus_1_fp32_per_row():
    shard = VocabShard(100, 50, 300)
    values, ids, sums = shard_topk(torch.randn(7, 50), shard, 16)
    packed = pack(values, ids, sums)
    assert packed.shape == (7, 33) and packed.dtype == torch.float32
    assert packed[:, 16:32].min() >= 100 and packed[:, 16:32].max() < 150  # global ids
    got = exchange(packed, 3, lambda out, inp: out.copy_(inp.repeat(3, 1)))
    assert got.shape == (21, 33)


def test_bad_input_is_named_before_any_work():
    with pytest.raises(ValueError, match=r"inside the vocabulary: ids \[90, 110\) of V = 100"):
        VocabShard(90, 20, 100)
    with pytest.raises(ValueError, match="exact only up to 2\\^24"):
        VocabShard(0, 10, MAX_VOCAB + 1)
    with pytest.raises(ValueError, match=r"must be \[rows, 50\]"):
        shard_topk(torch.randn(3, 40), VocabShard(0, 50, 100), 4)
    with pytest.raises(ValueError, match=r"k must be in \[1, V=100\]"):
        shard_topk(torch.randn(3, 50), VocabShard(0, 50, 100), 101)
    with pytest.raises(ValueError, match=r"world x K = 8"):
        merge(torch.zeros(4, 9), 2, 9)


def test_the_tree_reads_the_top_k_the_way_it_reads_logits(torch_one_thread):
    """build_tree_from_topk on the full vocabulary's top-K is build_tree, wider lists cut to K."""
    logits = torch.randn(2, 4, 50, generator=torch.Generator().manual_seed(3))
    lp, ids = tree.topk_log_probs(logits, 30)
    top = DraftTopK(lp, ids, torch.logsumexp(logits, -1))
    for budget, cap in [(10, None), (30, 4), (60, None)]:
        assert_same_tree(
            tree.build_tree_from_topk(top, budget, topk_cap=cap),
            tree.build_tree(logits, budget, topk_cap=min(cap or 30, 30)),
            f"B {budget} cap {cap}",
        )
    with pytest.raises(ValueError, match=r"\[batch, L, K\]"):
        tree.build_tree_from_topk(DraftTopK(lp[0], ids[0], lp[0, :, 0]), 4)
