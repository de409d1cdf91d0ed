"""The drafter's head at TP 2 on SGLang 0.5.23's real code on CPU: two processes, each with SGLang's
own parallel state (``publish`` + ``init_distributed_environment`` over gloo +
``initialize_model_parallel``), a real ``ParallelLMHead`` (its shard layout: real rows, padding,
added-vocabulary rows; a vocabulary the TP size does not divide) loaded through its own weight
loader, and the TP group's own ``all_gather_into_tensor``.

1. ``draft_head`` over that head: the merged top-K and the tree equal the single-rank ones from
   the full vocabulary, on both ranks; padding and added rows (filled to win every ranking) never
   ranked.
2. The worker path: ``DDTreeWorker.forward_batch_generation`` -> the tree round, whose drafter
   pass is the real ``SGLangRoundModels.draft_block`` (its ``ForwardBatch``, the KV plan over
   SGLang's pools, the ``draft_head`` call site) on a toy drafter runner: both ranks emit the
   target's greedy tokens, and every round's tree is the single-rank tree.

What does not run here: SGLang's GPU model runners (the drafter's real forward, the target's
verify) and NCCL; SGLang's CPU mode runs through the lab-only CPU layer (docs/sglang-cpu-lab.md),
as the real-server tests do.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.sglang

WORLD = 2
V, ADDED, H = 1100, 3, 16  # 1100 pads to 1152: rank 0 ids [0, 576), rank 1 [576, 1100) + 52 padding
POISON = 1e4  # padding and added rows: a logit that would top every row if it were ranked
HEAD_CASES = {"randn": (64, None), "ties": (16, None), "largest budget": (1023, None), "top-k cap": (20, 3)}
BUDGET, BLOCK = 7, 4


def _parallel_state(rank: int, init_file: str) -> None:
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import prepare_server_args

    from tests.fixtures_models import write_pair

    target, _draft = write_pair(Path(init_file).parent / f"models{rank}", "qwen3-8b")
    record = prepare_server_args(["--model-path", str(target), "--tp-size", str(WORLD), "--device", "cpu"])
    publish(record, role="scheduler", ranks=SpawnRanks(world_rank=rank))
    init_distributed_environment(
        world_size=WORLD, rank=rank, distributed_init_method=f"file://{init_file}", local_rank=rank,
        backend="gloo",
    )
    initialize_model_parallel()


def _lm_head(weight: torch.Tensor, vocab: int, added: int, padding: int = 64):
    """SGLang's ParallelLMHead for this rank, loaded by its own loader; padding and added rows
    poisoned after the load."""
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    head = ParallelLMHead(vocab + added, weight.shape[1], org_num_embeddings=vocab, padding_size=padding)
    head.weight_loader(head.weight, weight)
    with torch.no_grad():
        head.weight[head.shard_indices.num_org_elements :] = POISON
    return head


def head_inputs() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(V, H, generator=g)
    hidden = {"randn": torch.randn(30, H, generator=g), "largest budget": torch.randn(6, H, generator=g)}
    hidden["ties"] = torch.randn(12, H, generator=g)
    hidden["top-k cap"] = hidden["randn"]
    return weight, hidden


def head_ties_weight(weight: torch.Tensor) -> torch.Tensor:
    """Equal rows on both sides of the shard cut (ids 570-581) and at both ends: tied logits."""
    w = weight.clone()
    w[570:582] = w[0]
    w[1090:1100] = w[0]
    return w


def _rank_main(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    from tests.sglang._cpu_env import define_torchvision_op_schemas

    define_torchvision_op_schemas()
    _parallel_state(rank, init_file)
    from sglang.srt.runtime_context import get_parallel

    from ddtree_runtime.core import tree
    from ddtree_runtime.sglang_plugin.round.draft_head import draft_head

    group = get_parallel().tp_group
    weight, hidden = head_inputs()
    heads = {}
    for name, (budget, cap) in HEAD_CASES.items():
        w = head_ties_weight(weight) if name == "ties" else weight
        lm_head = _lm_head(w, V, ADDED)
        top = draft_head(hidden[name], lm_head, V, group, budget=budget, topk_cap=cap)
        heads[name] = (top, tree.build_tree_from_topk(top.reshape(1, -1), budget, topk_cap=cap))
    heads["shard"] = lm_head.shard_indices.org_vocab_start_index, lm_head.shard_indices.num_org_elements
    decode = _tp_decode(group)
    torch.save({"heads": heads, "decode": decode}, Path(out_dir) / f"rank{rank}.pt")


# --- the worker path ---------------------------------------------------------------------------


def _tp_decode(group) -> dict:
    """Six tree rounds of DDTreeWorker with the real SGLangRoundModels.draft_block under TP."""
    from sglang.srt.configs.draft_parallel import DraftParallelLayout
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    from sglang.srt.speculative.draft_worker_common import make_draft_block_spec_info

    from ddtree_runtime.core.decoder_settings import DecoderSettings
    from ddtree_runtime.sglang_plugin.algorithm import PluginSettings
    from ddtree_runtime.sglang_plugin.ddtree_worker import DDTreeWorker
    from ddtree_runtime.sglang_plugin.handshake import HandshakeState, static_handshake
    from ddtree_runtime.sglang_plugin.round.sglang_models import SGLangRoundModels
    from tests.sglang._tree_decode_toy import ToyModels, ToyTarget, make_pools
    from tests.sglang.test_tree_decode_worker import _batch

    target = ToyTarget(seed=3)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7]]
    req_pool, allocator, kv, draft_kv = make_pools(
        page_size=1, size=2048, head_dim=target.dim, rows=3, context=192, draft_dim=target.hidden_width
    )
    rows = req_pool.alloc_rows(len(prompts))
    for row, p in zip(rows, prompts, strict=True):
        req_pool.req_to_token[row, : len(p) + 96] = allocator.alloc(len(p) + 96).to(torch.int32)
    toy = ToyModels(target, req_pool.req_to_token, kv, draft_kv, noise=1.5)
    bonus = [toy.prefill(row, p) for row, p in zip(rows, prompts, strict=True)]

    def translator(pool):
        return KVIndexTranslator(
            req_to_token=req_pool.req_to_token, token_to_kv_pool_allocator=allocator,
            token_to_kv_pool=pool, page_size=1, device="cpu",
        )

    # The toy drafter's logits are its "hidden states"; an identity LM head over the toy's 12 ids,
    # split by SGLang (padding 8: rank 0 ids [0, 8), rank 1 [8, 12) + 4 padding rows), gives each
    # rank exactly its shard's logits.
    lm_head = _lm_head(torch.eye(target.vocab), target.vocab, 0, padding=8)
    seen: list[tuple[torch.Tensor, object]] = []

    def draft_forward(forward_batch):
        bs = forward_batch.batch_size
        logits = toy.draft_block(
            forward_batch.input_ids.view(bs, -1), forward_batch.positions.view(bs, -1),
            forward_batch.out_cache_loc, forward_batch.req_pool_indices,
        )
        seen.append((logits.view(bs, BLOCK, -1)[:, 1:].clone(), None))
        return SimpleNamespace(logits_output=SimpleNamespace(hidden_states=logits))

    settings = PluginSettings(DecoderSettings(BUDGET, BLOCK))
    worker = object.__new__(DDTreeWorker)
    worker.ddtree_settings = settings
    worker.block_size = BLOCK
    worker.speculative_num_draft_tokens = BUDGET + 1
    worker._mask_token_id = 11
    worker._target_worker = SimpleNamespace(
        model_runner=SimpleNamespace(
            token_to_kv_pool_allocator=allocator, req_to_token_pool=req_pool, token_to_kv_pool=kv,
            model=SimpleNamespace(lm_head=lm_head), kv_index_translator=translator(kv),
        )
    )
    worker.model_runner = SimpleNamespace(model_config=SimpleNamespace(vocab_size=target.vocab))
    worker.draft_model_runner = SimpleNamespace(
        forward=draft_forward, kv_index_translator=translator(draft_kv)
    )
    worker.draft_parallel_layout = DraftParallelLayout(tp_group=None, attn_tp_size=WORLD)
    worker._full_embed_gpu = torch.zeros(target.vocab, 4)
    worker._noise_embed_scale = 1.0
    worker._draft_block_spec_info = make_draft_block_spec_info(draft_token_num=BLOCK, device="cpu")
    worker._ddtree_contract = None
    worker._ddtree_handshake = HandshakeState(static_handshake(settings))
    worker._ddtree_metrics = None

    class Models(SGLangRoundModels):
        """The real drafter pass; the toy target's verify and drafter-context append."""

        def draft_block(self, *args):
            top = super().draft_block(*args)
            seen[-1] = (seen[-1][0], top)
            return top

        def target_verify(self, plan, cache_loc, req_pool_indices):
            return toy.target_verify(plan, cache_loc, req_pool_indices)

        def append_draft_context(self, hidden, cache_loc_2d, positions, commit_lens):
            toy.append_draft_context(hidden, cache_loc_2d, positions, commit_lens)

    worker._round_models = lambda batch: Models(worker, batch)
    seq_lens, out, draft_input = [len(p) for p in prompts], [[b] for b in bonus], None
    for _ in range(6):
        batch = _batch(rows, seq_lens, [o[-1] for o in out])
        batch.seq_lens_cpu = torch.tensor(seq_lens)
        batch.can_run_decode_cuda_graph = False
        if draft_input is not None:
            batch.spec_info = draft_input
        result = worker.forward_batch_generation(batch)
        tokens = result.next_token_ids.view(len(rows), result.speculative_output_stride)
        for i in range(len(rows)):
            out[i].extend(tokens[i, : int(result.accept_lens[i])].tolist())
        seq_lens, draft_input = result.new_seq_lens.tolist(), result.next_draft_input
    want = [target.reference_greedy(p, len(got)) for p, got in zip(prompts, out, strict=True)]
    return {"tokens": out, "want": want, "rounds": seen}


# --- the test ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("tp2")
    saved = {k: os.environ.get(k) for k in ("DDTREE_SGLANG_CPU_LAB", "SGLANG_USE_CPU_ENGINE")}
    # SGLang's CPU mode (gloo groups, its CPU collectives), loaded in the fresh interpreters.
    os.environ.update(DDTREE_SGLANG_CPU_LAB="1", SGLANG_USE_CPU_ENGINE="1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        mp.spawn(_rank_main, args=(str(tmp / "pg"), str(tmp)), nprocs=WORLD, join=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _same_tree(got, want, what: str) -> None:
    for field in ("tokens", "depths", "parents", "num_nodes"):
        assert torch.equal(getattr(got, field), getattr(want, field)), f"{what}: {field}"
    torch.testing.assert_close(got.scores, want.scores, rtol=0, atol=1e-5, msg=what)


def test_sglangs_shards_are_real_rows_then_padding(ranks):
    assert [r["heads"]["shard"] for r in ranks] == [(0, 576), (576, 524)]


def test_the_sharded_head_is_the_single_rank_head_on_both_ranks(ranks):
    from ddtree_runtime.core import tree

    weight, hidden = head_inputs()
    for name, (budget, cap) in HEAD_CASES.items():
        w = head_ties_weight(weight) if name == "ties" else weight
        logits = (hidden[name] @ w.T).unsqueeze(0)  # the full vocabulary, added rows not ranked
        want_tree = tree.build_tree(logits, budget, topk_cap=cap)
        top0, tree0 = ranks[0]["heads"][name]
        k = top0.k
        want_lp, want_ids = tree.topk_log_probs(logits, k)
        assert torch.equal(top0.ids, want_ids[0]), name
        torch.testing.assert_close(top0.log_probs, want_lp[0], rtol=0, atol=2e-6, msg=name)
        _same_tree(tree0, want_tree, name)
        top1, tree1 = ranks[1]["heads"][name]
        assert torch.equal(top1.log_probs, top0.log_probs) and torch.equal(top1.ids, top0.ids), name
        _same_tree(tree1, tree0, f"{name}, rank 1")


def test_the_worker_decodes_the_targets_greedy_tokens_at_tp2(ranks):
    from ddtree_runtime.core import tree
    from ddtree_runtime.core.tree import DraftTopK

    for r, rank in enumerate(ranks):
        decode = rank["decode"]
        assert decode["tokens"] == decode["want"], r
        assert sum(len(t) for t in decode["tokens"]) > 2 * 6 + 2  # trees accepted more than one token
        for i, (logits, top) in enumerate(decode["rounds"]):
            assert isinstance(top, DraftTopK), "under TP draft_block hands the tree the merged top-K"
            _same_tree(
                tree.build_tree_from_topk(top, BUDGET), tree.build_tree(logits, BUDGET), f"rank {r} round {i}"
            )
    assert ranks[0]["decode"]["tokens"] == ranks[1]["decode"]["tokens"]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("vocab", [12, 1100, 151936, 248320, 248077])
def test_vocab_shards_is_sglangs_layout(vocab, world):
    """``tp_head.vocab_shards`` (the benchmark's and unit tests' shards) = VocabParallelEmbedding's
    own ``_get_indices`` for the same vocabulary and TP size (the padding rule as its __init__)."""
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding, pad_vocab_size

    from ddtree_runtime.core.tp_head import vocab_shards

    padding = 64 if pad_vocab_size(vocab, 64) % world == 0 else 64 * world
    padded = pad_vocab_size(vocab, padding)
    for rank, shard in enumerate(vocab_shards(vocab, world)):
        want = VocabParallelEmbedding._get_indices(padded, padded, vocab, vocab, rank, world)
        assert (shard.start, shard.num) == (want.org_vocab_start_index, want.num_org_elements), rank
