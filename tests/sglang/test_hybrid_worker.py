"""DDTreeWorker's tree decode on a hybrid (GDN + attention) target, on CPU through SGLang's real
hybrid pool, GDN backend, tree kernels (interpreted) and tree-aware commit (tests/sglang/_hybrid_toy.py):
many rounds stay token-identical to the target's plain greedy decoding, and the recurrent state in
the request's mamba slot equals plain decoding's after every round. Also: the dense conv scratch
the plugin's hook gives DDTREE trees, and the worker-start checks."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from tests.sglang.conftest import ddtree_argv, resolve

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1",
        reason="SGLang's GDN kernels run on CPU only under TRITON_INTERPRET=1 (scripts/test.sh sets it)",
    ),
]

BUDGET, BLOCK = 9, 4
SCRATCH = max(BUDGET + 1, BLOCK)  # speculative_num_draft_tokens: what SGLang sizes the scratch by


@pytest.fixture
def publish_ddtree(sglang_plugins, tmp_path):
    """Publish a resolved DDTREE record as a scheduler process has it (what the dedup hook reads)."""
    from sglang.srt.runtime_context import publish, reset_context

    from tests.fixtures_models import write_pair

    target, draft = write_pair(tmp_path, "qwen3.6-27b")

    def _publish(*flags: str):
        reset_context()
        record, _ = resolve(ddtree_argv(target, draft, "--disable-radix-cache", *flags))
        publish(record, role="scheduler")
        return record._ddtree_resolved

    yield _publish
    reset_context()


def _settings(budget: int = BUDGET, topk_cap: int | None = None):
    from ddtree_runtime.core.decoder_settings import DecoderSettings
    from ddtree_runtime.sglang_plugin.algorithm import PluginSettings

    return PluginSettings(DecoderSettings(budget, BLOCK, topk_cap))


def _gdn_model_config():
    from sglang.srt.configs import Qwen3NextConfig

    return SimpleNamespace(hf_config=Qwen3NextConfig(), is_draft_model=False)


def _hybrid_worker(prompts, monkeypatch, noise=1.5):
    from sglang.srt.layers.attention import hybrid_linear_attn_backend

    from ddtree_runtime.sglang_plugin.ddtree_worker import DDTreeWorker
    from ddtree_runtime.sglang_plugin.handshake import HandshakeState, static_handshake
    from tests.sglang._hybrid_toy import (
        HybridToyModels,
        HybridToyTarget,
        alloc_requests,
        cpu_scatter_mamba_states_after_mtp_verify,
        make_backends,
        make_hybrid_pool,
    )
    from tests.sglang._tree_decode_toy import make_pools

    monkeypatch.setattr(
        hybrid_linear_attn_backend, "scatter_mamba_states_after_mtp_verify",
        cpu_scatter_mamba_states_after_mtp_verify,
    )
    target = HybridToyTarget(seed=3)
    _, allocator, kv, draft_kv = make_pools(
        page_size=1, size=2048, head_dim=target.dim, rows=2, context=8, draft_dim=target.hidden_width
    )
    pool = make_hybrid_pool(rows=len(prompts) + 2, context=192, scratch_rows=SCRATCH)
    pool.alloc_rows(1)  # row 0 taken first: the requests sit in rows (and mamba slots) past it
    rows = alloc_requests(pool, len(prompts))
    for row, p in zip(rows, prompts, strict=True):
        pool.req_to_token[row, : len(p) + 96] = allocator.alloc(len(p) + 96).to(torch.int32)
    backend, linear = make_backends(pool)
    toy = HybridToyModels(target, pool.req_to_token, kv, draft_kv, pool=pool, backend=backend, noise=noise)
    bonus = [toy.prefill(row, p) for row, p in zip(rows, prompts, strict=True)]

    worker = object.__new__(DDTreeWorker)
    worker.ddtree_settings = _settings()
    worker.block_size = BLOCK
    worker.speculative_num_draft_tokens = SCRATCH
    worker._mask_token_id = 11
    worker._need_mamba_verify_commit = True  # what DFlashWorkerV2 sets for a mamba-ish target
    worker._target_worker = SimpleNamespace(
        model_runner=SimpleNamespace(
            token_to_kv_pool_allocator=allocator, req_to_token_pool=pool, token_to_kv_pool=kv,
            model_config=_gdn_model_config(), attn_backend=backend, model=None,
        )
    )
    worker._ddtree_contract = None
    worker._ddtree_handshake = HandshakeState(static_handshake(worker.ddtree_settings))
    worker._ddtree_metrics = None
    worker._round_models = lambda batch: toy
    return worker, toy, rows, bonus, linear


def _batch(rows, seq_lens, bonus, draft_input=None):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

    return SimpleNamespace(
        forward_mode=ForwardMode.DECODE, is_extend_in_batch=False, has_grammar=False, return_logprob=False,
        spec_info=draft_input or make_draft_input_v2(
            bonus_tokens=torch.tensor(bonus), new_seq_lens=torch.tensor(seq_lens)
        ),
        req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(seq_lens), sampling_info=None,
        seq_lens_cpu=torch.tensor(seq_lens),  # the non-overlap scheduler's host copy
        mamba_track_indices=None,
        reqs=[
            SimpleNamespace(
                sampling_params=SimpleNamespace(stop_token_ids=None, ignore_eos=True), eos_token_ids=set()
            )
            for _ in rows
        ],
    )


def _slot_state(toy, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    slot = int(toy.pool.get_mamba_indices(torch.tensor([row]))[0])
    cache = toy.pool.mamba_pool.mamba_cache
    return cache.conv[0][0, slot], cache.temporal[0, slot].transpose(-1, -2)


def test_hybrid_tree_rounds_are_token_identical_to_greedy_and_commit_plain_decodings_state(
    publish_ddtree, monkeypatch
):
    publish_ddtree("--speculative-ddtree-budget", str(BUDGET))
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8]]
    worker, toy, rows, bonus, linear = _hybrid_worker(prompts, monkeypatch)
    assert toy.pool.mamba_pool.mamba_cache.intermediate_conv_window[0].is_contiguous()  # dense
    seq_lens = [len(p) for p in prompts]
    out = [[b] for b in bonus]
    draft_input, accepted, rounds = None, [], 8
    for _ in range(rounds):
        result = worker.forward_batch_generation(_batch(rows, seq_lens, [o[-1] for o in out], draft_input))
        tokens = result.next_token_ids.view(len(rows), -1)
        for i in range(len(rows)):
            n = int(result.accept_lens[i])
            out[i].extend(tokens[i, :n].tolist())
            accepted.append(n - 1)
        seq_lens = result.new_seq_lens.tolist()
        draft_input = result.next_draft_input
        assert linear.topk == 2  # in tree mode from construction (graph_sites), and it stays so
        for i, (row, p) in enumerate(zip(rows, prompts, strict=True)):
            committed = p + out[i][:-1]  # the new bonus token is not in the state yet
            assert seq_lens[i] == len(committed)
            _, window, state = toy.target.mixed_rows(committed)
            got_window, got_state = _slot_state(toy, row)
            assert torch.allclose(got_window, window, atol=1e-5), i
            assert torch.allclose(got_state, state, atol=1e-5), i
    for p, got in zip(prompts, out, strict=True):
        assert got == toy.target.reference_greedy(p, len(got))
    assert toy.verifies == rounds
    assert max(accepted) >= 2 and 0 in accepted  # deep acceptances and rejections both happened


def test_commit_fills_the_mamba_radix_track_slot_at_the_crossing_node(publish_ddtree, monkeypatch):
    """With the mamba radix cache's extra buffer, the state at the track-interval crossing (a node
    inside the accepted path, by tree node index) goes to the request's track slot."""
    from sglang.srt.speculative import spec_utils

    publish_ddtree("--speculative-ddtree-budget", str(BUDGET))
    interval = 8
    monkeypatch.setattr(spec_utils, "mamba_track_grid", lambda page_size: interval)
    prompt = [3, 1, 4, 1, 5, 9]  # 6 committed: the round crosses 8 once 3 tokens are accepted
    worker, toy, rows, bonus, _ = _hybrid_worker([prompt], monkeypatch, noise=0.0)
    track_slot = toy.pool.mamba_pool.size - 1  # a free slot standing for the ping-pong buffer
    batch = _batch(rows, [len(prompt)], bonus)
    batch.mamba_track_indices = torch.tensor([track_slot])
    batch.tree_cache = SimpleNamespace(page_size=1)
    result = worker.forward_batch_generation(batch)
    n = int(result.accept_lens[0])
    assert len(prompt) + n >= interval  # a perfect drafter accepted past the crossing
    emitted = [bonus[0], *result.next_token_ids[:n].tolist()]
    upto = interval - len(prompt)  # tokens of this round that the crossing state has consumed
    _, window, state = toy.target.mixed_rows(prompt + emitted[:upto])
    cache = toy.pool.mamba_pool.mamba_cache
    assert torch.allclose(cache.temporal[0, track_slot].transpose(-1, -2), state, atol=1e-5)
    assert torch.allclose(cache.conv[0][0, track_slot], window, atol=1e-5)


def test_dedup_hook_gives_ddtree_trees_the_dense_conv_scratch_and_chains_keep_dflashs(publish_ddtree):
    from sglang.srt.mem_cache import memory_pool

    from tests.sglang._hybrid_toy import make_hybrid_pool

    def layout() -> bool:
        pool = make_hybrid_pool(rows=2, context=32, scratch_rows=SCRATCH)
        return pool.mamba_pool.mamba_cache.intermediate_conv_window[0].is_contiguous()

    assert memory_pool.conv_window_dedup_enabled.__wrapped__  # the plugin's hook is applied
    publish_ddtree("--speculative-ddtree-budget", "15", "--speculative-ddtree-topk-cap", "1")
    assert layout() is False  # the chain case is DFLASH: SGLang's deduplicated chain layout
    publish_ddtree("--speculative-ddtree-budget", "24")
    assert layout() is True  # a DDTREE tree: dense per-row windows
    assert memory_pool.conv_window_dedup_enabled(False, False, 1, False) is False


def test_worker_start_refuses_a_hybrid_pool_that_cannot_hold_a_tree(publish_ddtree):
    from sglang.srt.configs import NemotronHConfig

    from ddtree_runtime.sglang_plugin.refusals.worker_start import (
        TreeDecodeNotAvailable,
        check_tree_worker_features,
    )
    from tests.sglang._hybrid_toy import make_hybrid_pool

    def worker(pool, model_config=None):
        runner = SimpleNamespace(model_config=model_config or _gdn_model_config(), req_to_token_pool=pool)
        target_worker = SimpleNamespace(model_runner=runner)
        return SimpleNamespace(_need_mamba_verify_commit=True, target_worker=target_worker)

    publish_ddtree("--speculative-ddtree-budget", str(BUDGET))
    dense = make_hybrid_pool(rows=2, context=32, scratch_rows=SCRATCH)
    check_tree_worker_features(_settings(), worker(dense))
    with pytest.raises(TreeDecodeNotAvailable, match=r"holds 10 rows per request; a DDTREE verify writes 17"):
        check_tree_worker_features(_settings(budget=16), worker(dense))
    nemotron = SimpleNamespace(hf_config=NemotronHConfig(), is_draft_model=False)
    with pytest.raises(TreeDecodeNotAvailable, match="Mamba2"):
        check_tree_worker_features(_settings(), worker(dense, nemotron))
    publish_ddtree("--speculative-ddtree-budget", "15", "--speculative-ddtree-topk-cap", "1")
    chain_layout = make_hybrid_pool(rows=2, context=32, scratch_rows=SCRATCH)  # built as for DFLASH
    with pytest.raises(TreeDecodeNotAvailable, match="deduplicated chain layout"):
        check_tree_worker_features(_settings(), worker(chain_layout))
    check_tree_worker_features(_settings(topk_cap=1, budget=BLOCK - 1), worker(chain_layout))  # DFlash's


def test_a_stop_token_inside_the_accepted_path_commits_the_truncated_nodes_state(publish_ddtree, monkeypatch):
    publish_ddtree("--speculative-ddtree-budget", str(BUDGET))
    prompt = [3, 1, 4, 1, 5]
    free, _, rows, bonus, _ = _hybrid_worker([prompt], monkeypatch, noise=0.0)  # a perfect drafter
    first = free.forward_batch_generation(_batch(rows, [len(prompt)], bonus))
    n = int(first.accept_lens[0])
    tokens = first.next_token_ids[:n].tolist()
    assert n >= 3 and tokens[1] != tokens[0]
    worker, toy, rows, bonus, _ = _hybrid_worker([prompt], monkeypatch, noise=0.0)
    batch = _batch(rows, [len(prompt)], bonus)
    batch.reqs[0].sampling_params.ignore_eos = False
    batch.reqs[0].eos_token_ids = {tokens[1]}
    res = worker.forward_batch_generation(batch)
    assert int(res.accept_lens[0]) == 2 and res.new_seq_lens.tolist() == [len(prompt) + 2]
    _, window, state = toy.target.mixed_rows([*prompt, bonus[0], tokens[0]])  # root + one accepted node
    got_window, got_state = _slot_state(toy, rows[0])
    assert torch.allclose(got_window, window, atol=1e-5) and torch.allclose(got_state, state, atol=1e-5)
