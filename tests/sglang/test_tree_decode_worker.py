"""DDTreeWorker's own decode path on CPU: ``forward_batch_generation`` -> ``_tree_decode`` ->
the tree round over SGLang's real pools, returning SGLang's real ``GenerationBatchResult`` and
``DFlashDraftInputV2``. Only the model passes are injected (``_round_models``: the toy of
tests/sglang/_tree_decode_toy.py); the batch is a plain namespace with ScheduleBatch's fields."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.sglang._tree_decode_toy import ToyModels, ToyTarget, make_pools

pytestmark = pytest.mark.sglang

BUDGET, BLOCK = 7, 4


def _worker(page_size: int, settings: Any, prompts: list[list[int]], noise: float = 1.5):
    from ddtree_runtime.sglang_plugin.ddtree_worker import DDTreeWorker
    from ddtree_runtime.sglang_plugin.handshake import HandshakeState, static_handshake

    target = ToyTarget(seed=3)
    req_pool, allocator, kv, draft_kv = make_pools(
        page_size=page_size,
        size=2048,
        head_dim=target.dim,
        rows=len(prompts) + 1,
        context=192,
        draft_dim=target.hidden_width,
    )
    rows = req_pool.alloc_rows(len(prompts))
    start = allocator.available_size()
    allocated = []
    for row, p in zip(rows, prompts, strict=True):
        n = -(-(len(p) + 96) // page_size) * page_size  # prompt + the scheduler's decode reservation
        req_pool.req_to_token[row, :n] = allocator.alloc(n).to(torch.int32)
        allocated.append(n)
    toy = ToyModels(target, req_pool.req_to_token, kv, draft_kv, noise=noise)
    bonus = [toy.prefill(row, p) for row, p in zip(rows, prompts, strict=True)]

    worker = object.__new__(DDTreeWorker)  # no GPU: the runners are the pools, the model is the toy
    worker.ddtree_settings = settings
    worker.block_size = settings.decoder.block_size
    worker.speculative_num_draft_tokens = settings.decoder.kv_window
    worker._mask_token_id = 11
    worker._target_worker = SimpleNamespace(
        model_runner=SimpleNamespace(
            token_to_kv_pool_allocator=allocator, req_to_token_pool=req_pool, token_to_kv_pool=kv
        )
    )
    worker._ddtree_contract = None
    worker._ddtree_handshake = HandshakeState(static_handshake(settings))
    worker._ddtree_metrics = None
    worker._round_models = lambda batch: toy
    return worker, toy, rows, bonus, (allocator, start, allocated)


def _batch(rows, seq_lens, bonus, eos=()):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

    return SimpleNamespace(
        forward_mode=ForwardMode.DECODE,
        is_extend_in_batch=False,
        has_grammar=False,
        return_logprob=False,
        spec_info=make_draft_input_v2(bonus_tokens=torch.tensor(bonus), new_seq_lens=torch.tensor(seq_lens)),
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq_lens),
        seq_lens_cpu=torch.tensor(seq_lens),  # the non-overlap scheduler's host copy
        sampling_info=None,
        reqs=[
            SimpleNamespace(
                sampling_params=SimpleNamespace(stop_token_ids=None, ignore_eos=False), eos_token_ids=set(eos)
            )
            for _ in rows
        ],
    )


def _settings(budget: int = BUDGET, topk_cap: int | None = None):
    from ddtree_runtime.core.decoder_settings import DecoderSettings
    from ddtree_runtime.sglang_plugin.algorithm import PluginSettings

    return PluginSettings(DecoderSettings(budget, BLOCK, topk_cap))


@pytest.mark.parametrize("page_size", [1, 16])
def test_worker_tree_decode_reproduces_target_greedy(page_size):
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2

    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7]]
    worker, toy, rows, bonus, (allocator, start, allocated) = _worker(page_size, _settings(), prompts)
    seq_lens = [len(p) for p in prompts]
    out = [[b] for b in bonus]
    draft_input = None
    for _ in range(6):
        batch = _batch(rows, seq_lens, [o[-1] for o in out])
        if draft_input is not None:
            batch.spec_info = draft_input
        published = []
        result = worker.forward_batch_generation(batch, on_publish=published.append)
        assert isinstance(result, GenerationBatchResult)
        assert isinstance(result.next_draft_input, DFlashDraftInputV2)
        assert result.speculative_num_draft_tokens == BUDGET + 1 and result.can_run_cuda_graph is False
        stride = result.speculative_output_stride
        assert stride == BLOCK  # L + 1 output columns per request
        tokens = result.next_token_ids.view(len(rows), stride)
        for i in range(len(rows)):
            out[i].extend(tokens[i, : int(result.accept_lens[i])].tolist())
        assert torch.equal(published[-1], result.new_seq_lens)
        seq_lens = result.new_seq_lens.tolist()
        draft_input = result.next_draft_input
        assert draft_input.bonus_tokens.tolist() == [o[-1] for o in out]
    for p, got in zip(prompts, out, strict=True):
        assert got == toy.target.reference_greedy(p, len(got))
    assert worker.ddtree_handshake()["observed_hidden_width"] == toy.target.hidden_width
    assert worker.ddtree_handshake()["status"] == "ok"
    allocator.free(torch.cat([toy.req_to_token[r, :n].long() for r, n in zip(rows, allocated, strict=True)]))
    assert allocator.available_size() == start


def test_worker_tree_decode_stops_at_eos_inside_the_accepted_path():
    prompts = [[3, 1, 4, 1, 5]]
    free, _, rows, bonus, _ = _worker(1, _settings(), prompts, noise=0.0)  # a perfect drafter
    first = free.forward_batch_generation(_batch(rows, [5], bonus))
    n = int(first.accept_lens[0])
    assert n >= 3
    tokens = first.next_token_ids[:n].tolist()
    eos = tokens[1]
    assert eos != tokens[0]
    worker, _toy, rows, bonus, _ = _worker(1, _settings(), prompts, noise=0.0)
    res = worker.forward_batch_generation(_batch(rows, [5], bonus, eos=[eos]))
    assert int(res.accept_lens[0]) == 2 and res.next_token_ids[:2].tolist() == tokens[:2]
    assert res.new_seq_lens.tolist() == [5 + 2]


def test_chain_prefill_and_idle_batches_run_dflashs_own_code(monkeypatch):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    calls = []
    monkeypatch.setattr(
        DFlashWorkerV2, "forward_batch_generation", lambda self, batch, **kw: calls.append(batch)
    )
    tree, _toy, rows, bonus, _ = _worker(1, _settings(), [[1, 2, 3]])
    chain, *_ = _worker(1, _settings(topk_cap=1, budget=BLOCK - 1), [[1, 2, 3]])
    decode = _batch(rows, [3], bonus)
    chain.forward_batch_generation(decode)
    assert calls == [decode]
    for mode in (ForwardMode.EXTEND, ForwardMode.IDLE):
        batch = _batch(rows, [3], bonus)
        batch.forward_mode = mode
        tree.forward_batch_generation(batch)
        assert calls[-1] is batch
    assert len(calls) == 3
    tree.forward_batch_generation(decode)  # the tree decode: not DFlash's
    assert len(calls) == 3


def test_round_input_reads_sglangs_sampling_and_stop_fields():
    from ddtree_runtime.sglang_plugin.ddtree_info import round_input, stop_ids

    info = SimpleNamespace(
        is_all_greedy=False,
        top_ks=torch.tensor([1, 40]),
        temperatures=torch.tensor([[0.7], [0.9]]),
        top_ps=torch.tensor([1.0, 0.8]),
    )
    batch = _batch([1, 2], [4, 6], [5, 6], eos=[2])
    batch.sampling_info = info
    batch.reqs[1].sampling_params = SimpleNamespace(stop_token_ids={7}, ignore_eos=True)
    inp = round_input(batch, torch.tensor([5, 6]))
    assert inp.temperatures.tolist() == pytest.approx([0.0, 0.9])  # top_k <= 1 is SGLang's greedy
    assert inp.top_ps.tolist() == pytest.approx([1.0, 0.8])
    assert inp.stop_token_ids == (frozenset({2}), frozenset({7}))
    assert stop_ids(batch.reqs[0]) == frozenset({2})
    batch.sampling_info = SimpleNamespace(is_all_greedy=True)
    assert round_input(batch, torch.tensor([5, 6])).temperatures is None


def test_grammar_requests_fail_with_the_reason():
    worker, _toy, rows, bonus, _ = _worker(1, _settings(), [[1, 2, 3]])
    batch = _batch(rows, [3], bonus)
    batch.has_grammar = True
    with pytest.raises(RuntimeError, match="grammar-constrained"):
        worker.forward_batch_generation(batch)


def test_the_gpu_adapter_speaks_the_pinned_releases_api():
    """What cannot run here (no CUDA SGLang) is at least checked against the installed 0.5.23: the
    adapter imports, and every keyword it passes exists in the callee's signature."""
    import inspect

    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from ddtree_runtime.sglang_plugin.ddtree_info import DDTreeVerifyInput
    from ddtree_runtime.sglang_plugin.round import sglang_models

    source = inspect.getsource(sglang_models)

    def kwargs_of(call: str) -> set[str]:
        """Keyword names of the first ``call(...)`` in the adapter's source."""
        import re

        body = source[source.index(call + "(") + len(call) + 1 :]
        depth = 1
        for end, ch in enumerate(body):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                return set(re.findall(r"^\s*(\w+)=", body[:end], flags=re.M))
        raise AssertionError(f"unbalanced call {call}")

    checks = {
        "ForwardBatch": sglang_models.ForwardBatch,
        "DDTreeVerifyInput": DDTreeVerifyInput,
        "kv_index_translator.plan": KVIndexTranslator.plan,
        "apply_dflash_verify_logits_adjustments": sglang_models.apply_dflash_verify_logits_adjustments,
        "._append_target_hidden_to_draft_kv_by_loc": DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc,
    }
    for call, target in checks.items():
        used = kwargs_of(call)
        assert used, call
        params = set(inspect.signature(target).parameters)
        assert used <= params, (call, used - params)
    for name in (
        "_full_embed_gpu",
        "_noise_embed_scale",
        "_draft_block_spec_info",
        "_target_logits_processor",
    ):
        assert name in inspect.getsource(DFlashWorkerV2.__init__), name
