"""The tree round's graph stages (``round_graphs``) on CPU: buckets run the stages eagerly on their
static buffers (``capture=False``), so the staging, the padding of a batch smaller than its bucket,
the stop table and the in-place mask cells are checked against the eager round on SGLang's real
pools, with the toy models (tests/sglang/_tree_decode_toy.py). The CUDA capture and replay of the
same buckets is tests/gpu/test_round_graphs_gpu.py."""

from __future__ import annotations

import pytest
import torch

from ddtree_runtime.core.tree import (
    build_tree,
    compile_tree,
    verify_attention_mask_flat,
    write_tree_mask_cells,
)
from ddtree_runtime.sglang_plugin.round.round_graphs import STOP_WIDTH, GraphSpec, RoundGraphs
from ddtree_runtime.sglang_plugin.round.tree_round import RoundInput, run_tree_round
from tests.sglang.test_tree_decode import _setup

pytestmark = pytest.mark.sglang

CONTEXT = 256


def _graphs(cfg, kv, *, sizes, vocab, max_bs=8):
    rows = cfg.verify_rows
    spec = GraphSpec(
        cfg=cfg,
        head=lambda hidden: hidden.float(),  # the toy's depth rows are its logits
        hidden_size=vocab,
        hidden_dtype=torch.float32,
        kv_pool=kv,
        # SGLang's buffer starts zeroed (False): a reader of a prefix cell would see "hidden"
        mask_buffer=torch.zeros(max_bs * rows * (CONTEXT + rows), dtype=torch.bool),
        mask_max_bs=max_bs,
    )
    graphs = RoundGraphs(spec, torch.device("cpu"), capture=False)
    assert graphs.build(sizes) == sorted(s for s in sizes if s <= max_bs)
    return graphs


def _decode(
    prompts, n_tokens, *, graphs_sizes=None, stop=None, page_size=1, temperatures=None, depth_first=False
):
    """Decode every prompt to ``n_tokens`` with the tree round, eagerly or through bucket stages;
    the batch shrinks as requests finish (so it moves between buckets)."""
    target, models, rows, _allocated, _allocator, _start, bonus, cfg, kv = _setup(
        prompts, page_size=page_size, depth_first=depth_first
    )
    graphs = None
    if graphs_sizes is not None:
        graphs = _graphs(cfg, kv, sizes=graphs_sizes, vocab=target.vocab)
        models.prefix_always_visible = True
    out = [[b] for b in bonus]
    prefix = [len(p) for p in prompts]
    live = list(range(len(prompts)))
    staged_rounds = 0
    while live:
        inp = RoundInput(
            req_pool_indices=torch.tensor([rows[r] for r in live]),
            prefix_lens=torch.tensor([prefix[r] for r in live]),
            bonus_tokens=torch.tensor([out[r][-1] for r in live]),
            temperatures=None if temperatures is None else torch.tensor([temperatures[r] for r in live]),
            stop_token_ids=None if stop is None else tuple(frozenset(stop) for _ in live),
            mask_cells=cfg.verify_rows * (sum(prefix[r] for r in live) + cfg.verify_rows * len(live)),
        )
        if graphs is not None and graphs.plan_stage(len(live), inp) is not None:
            staged_rounds += 1
        res = run_tree_round(models, inp, cfg, req_to_token=models.req_to_token, kv_pool=kv, graphs=graphs)
        still = []
        for i, r in enumerate(live):
            n = int(res.commit_lens[i])
            out[r].extend(res.out_tokens[i, :n].tolist())
            prefix[r] = int(res.new_seq_lens[i])
            if not bool(res.finished[i]) and len(out[r]) < n_tokens:
                still.append(r)
        live = still
    return out, models, rows, prefix, staged_rounds


PROMPTS = [[1, 4, 2], [5, 3, 3, 7, 0, 9, 2], [8, 1, 6, 6, 2, 0, 4, 10, 3, 5, 7, 1]]


@pytest.mark.parametrize(("page_size", "depth_first"), [(1, False), (16, False), (1, True)])
def test_bucket_stages_emit_the_targets_greedy_tokens_as_the_eager_round_does(page_size, depth_first):
    # 3 requests run in bucket 4 (one padded row), then 2 in bucket 2, then 1 in bucket 1
    eager, *_ = _decode(PROMPTS, 24, page_size=page_size, depth_first=depth_first)
    staged, models, rows, lens, staged_rounds = _decode(
        PROMPTS, 24, graphs_sizes=[1, 2, 4], page_size=page_size, depth_first=depth_first
    )
    assert staged_rounds > 0
    assert staged == eager
    for r, (p, got) in enumerate(zip(PROMPTS, staged, strict=True)):
        assert got == models.target.reference_greedy(p, len(got))
        # the drafter's context holds every committed token, read back from its pool
        seq = p + got[:-1]
        assert lens[r] == len(seq)
        slots = models.req_to_token[rows[r], : len(seq)].long()
        hidden = models.draft_kv.get_key_buffer(0)[slots, 0]
        assert models.target.token_of(hidden, torch.arange(len(seq))).tolist() == seq


def test_a_padded_row_moves_no_kv():
    """A batch of 1 in a bucket of 4: the three padded rows' accept stage must not touch the pool
    (their slots are 0 -> 0 moves into SGLang's dummy slot), whatever their stale tree says."""
    target, models, rows, *_rest, bonus, cfg, kv = _setup(PROMPTS[:1])
    graphs = _graphs(cfg, kv, sizes=[4], vocab=target.vocab)
    models.prefix_always_visible = True
    bucket = graphs.buckets[4]
    bucket.prefix.fill_(3)  # stale rows from an earlier, larger batch
    bucket.posterior.random_(0, target.vocab)
    bucket.slots.copy_(torch.arange(1000, 1000 + bucket.slots.numel()).view_as(bucket.slots))
    before = kv.get_key_buffer(0).clone()
    inp = RoundInput(
        req_pool_indices=torch.tensor([rows[0]]),
        prefix_lens=torch.tensor([len(PROMPTS[0])]),
        bonus_tokens=torch.tensor([bonus[0]]),
        mask_cells=cfg.verify_rows * (len(PROMPTS[0]) + cfg.verify_rows),
    )
    res = run_tree_round(models, inp, cfg, req_to_token=models.req_to_token, kv_pool=kv, graphs=graphs)
    window = models.req_to_token[rows[0], len(PROMPTS[0]) : len(PROMPTS[0]) + cfg.write_window].long()
    changed = (kv.get_key_buffer(0) != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(changed) <= set(window.tolist()) | {0}
    assert bucket.slots[1:].eq(0).all()
    n = int(res.commit_lens[0])
    assert res.out_tokens[0, :n].tolist() == target.reference_greedy(PROMPTS[0], 1 + n)[1:]


def test_stop_tokens_cut_the_round_inside_the_bucket_and_wide_stop_sets_run_eagerly():
    eager, *_ = _decode(PROMPTS, 24, stop=[3])
    staged, *_rest, staged_rounds = _decode(PROMPTS, 24, graphs_sizes=[4], stop=[3])
    assert staged == eager and staged_rounds > 0
    assert any(3 in out[1:] for out in staged)  # a stop token was emitted and ended its request
    for out in staged:
        assert 3 not in out[1:-1]  # nothing after a stop token
    wide = list(range(STOP_WIDTH + 1, 2 * STOP_WIDTH + 3))  # more ids than the table holds
    eager_wide, *_ = _decode(PROMPTS, 16, stop=wide)
    staged_wide, *_ = _decode(PROMPTS, 16, graphs_sizes=[4], stop=wide)
    assert staged_wide == eager_wide


def test_sampled_rounds_take_the_plan_stage_and_walk_eagerly():
    torch.manual_seed(0)
    staged, models, *_ = _decode(PROMPTS[:2], 16, graphs_sizes=[2], temperatures=[0.0, 0.0])
    assert staged == [
        models.target.reference_greedy(p, len(o)) for p, o in zip(PROMPTS[:2], staged, strict=True)
    ]


def test_tree_mask_cells_are_the_flat_masks_tree_cells_and_nothing_else():
    torch.manual_seed(3)
    logits = torch.randn(3, 4, 30)
    tree = build_tree(logits, 7)
    prefix = torch.tensor([5, 0, 11])
    inputs = compile_tree(tree, torch.tensor([1, 2, 3]), prefix)
    rows = 8
    cells = int((rows * (prefix + rows)).sum())
    full = verify_attention_mask_flat(inputs, prefix, cells)
    sentinel = torch.full((cells + 50,), 7, dtype=torch.uint8)
    written = write_tree_mask_cells(inputs, prefix, sentinel.clone())
    # exactly the tree cells (b * rows * rows), none in a prefix or past the batch
    tree_cells = torch.zeros(cells + 50, dtype=torch.bool)
    start = 0
    for p in prefix.tolist():
        for i in range(rows):
            tree_cells[start + i * (p + rows) + p : start + i * (p + rows) + p + rows] = True
        start += rows * (p + rows)
        assert full[start - rows * (p + rows) : start].view(rows, p + rows)[:, :p].all()
    assert torch.equal(written[tree_cells].bool(), full[tree_cells[:cells]])
    assert (written[~tree_cells] == 7).all()


def test_what_sglang_reads_from_a_staged_round_is_contiguous():
    """SGLang's kernels read some of a round's outputs by raw pointer with stride 1 (the hybrid
    state commit reads commit_lens so): a strided view of a packed buffer read every request's
    count from the wrong place at batch > 1 (found on the H100, hybrid pair, batch 4)."""
    target, models, rows, *_rest, bonus, cfg, kv = _setup(PROMPTS)
    graphs = _graphs(cfg, kv, sizes=[4], vocab=target.vocab)
    models.prefix_always_visible = True
    inp = RoundInput(
        req_pool_indices=torch.tensor(rows),
        prefix_lens=torch.tensor([len(p) for p in PROMPTS]),
        bonus_tokens=torch.tensor(bonus),
        mask_cells=cfg.verify_rows * (sum(len(p) for p in PROMPTS) + cfg.verify_rows * 3),
    )
    res = run_tree_round(models, inp, cfg, req_to_token=models.req_to_token, kv_pool=kv, graphs=graphs)
    for name in ("out_tokens", "commit_lens", "new_seq_lens", "bonus_tokens", "accept_length"):
        assert getattr(res, name).is_contiguous(), name
    assert res.accept.accept_index.is_contiguous()
