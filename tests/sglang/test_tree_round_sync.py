"""The tree decode round meets SGLang's overlap contract on CPU: ``DDTreeWorker.forward_batch_generation``
reads nothing back from the device between entering and returning, publishes the new lengths before
the drafter's context append, and never rewrites a ``req_to_token`` row after the verify.

The device is simulated (tests/sglang/_device_guard.py): the batch's tensors, the pools' row table
and everything the model passes return are ``DeviceTensor``s, whose host reads raise. The batch is
shaped as under ``event_loop_overlap``: ``seq_lens_cpu`` None, the reserved lengths
``nxt_kv_lens_cpu`` on the host. On a GPU the same is checked with CUDA's sync debug mode
(tests/gpu/test_real_server_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.sglang._device_guard import GuardedModels, HostRead, on_device, on_host
from tests.sglang.test_tree_decode_worker import BLOCK, BUDGET, _batch, _settings, _worker

pytestmark = pytest.mark.sglang

WINDOW = max(BUDGET + 1, BLOCK)


def _guarded_worker(page_size: int, prompts: list[list[int]], calls: list[str]):
    worker, toy, rows, bonus, pools = _worker(page_size, _settings(), prompts)
    req_pool = worker._target_worker.model_runner.req_to_token_pool
    req_pool.req_to_token = on_device(req_pool.req_to_token)  # same storage: the toy still sees it
    worker._round_models = lambda batch: GuardedModels(toy, calls)
    return worker, toy, rows, bonus, pools


def _overlap_batch(rows, seq_lens, bonus, draft_input=None, *, sampling=None, eos=()):
    """A decode batch as the overlap scheduler hands it over: device tensors, no host lengths, the
    reservation's bound (prefix + 2 windows, DFlashDraftInputV2.prepare_for_decode)."""
    batch = _batch(rows, seq_lens, bonus, eos=eos)
    batch.seq_lens_cpu = None
    batch.req_pool_indices = on_device(batch.req_pool_indices)
    batch.seq_lens = on_device(batch.seq_lens)
    if draft_input is not None:
        batch.spec_info = draft_input
    batch.spec_info.bonus_tokens = on_device(on_host(batch.spec_info.bonus_tokens))
    bound = torch.tensor(seq_lens) + 2 * WINDOW
    batch.spec_info.nxt_kv_lens_cpu = bound
    batch.spec_info.nxt_kv_lens_sum = int(bound.sum())
    batch.sampling_info = sampling
    return batch


def _sampling(temperatures: list[float]):
    return SimpleNamespace(
        is_all_greedy=False,
        top_ks=on_device(torch.tensor([1 if t == 0 else 8 for t in temperatures])),
        temperatures=on_device(torch.tensor(temperatures).view(-1, 1)),
        top_ps=on_device(torch.ones(len(temperatures))),
    )


def _decode(worker, rows, bonus, prompts, rounds, *, sampling=None, calls=None):
    seq_lens = [len(p) for p in prompts]
    out = [[b] for b in bonus]
    draft_input = None
    for _ in range(rounds):
        published = []
        batch = _overlap_batch(rows, seq_lens, [o[-1] for o in out], draft_input, sampling=sampling)

        def publish(lens, published=published):
            published.append(on_host(lens))
            if calls is not None:
                calls.append("publish")

        result = worker.forward_batch_generation(batch, on_publish=publish)
        assert len(published) == 1
        stride = result.speculative_output_stride
        tokens = on_host(result.next_token_ids).view(len(rows), stride)
        for i in range(len(rows)):
            out[i].extend(tokens[i, : int(on_host(result.accept_lens)[i])].tolist())
        seq_lens = on_host(result.new_seq_lens).tolist()
        assert published[0].tolist() == seq_lens
        draft_input = result.next_draft_input
    return out


@pytest.mark.parametrize("depth_first", [False, True], ids=["heap", "depth-first"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_tree_decode_reads_nothing_back_and_stays_lossless(page_size, depth_first, monkeypatch):
    from ddtree_runtime.sglang_plugin.gdn_verify_kernel import SWITCH

    monkeypatch.setenv(SWITCH, "1" if depth_first else "0")  # the rows depth first (the parent reuse's)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7]]
    calls: list[str] = []
    worker, toy, rows, bonus, _ = _guarded_worker(page_size, prompts, calls)
    out = _decode(worker, rows, bonus, prompts, 5, calls=calls)
    for p, got in zip(prompts, out, strict=True):
        assert got == toy.target.reference_greedy(p, len(got))
    # every round: the lengths go out before the drafter's context append, as DFlashWorkerV2 does
    per_round = [c for c in calls if c in ("publish", "append_draft_context")]
    assert per_round == ["publish", "append_draft_context"] * 5


def test_sampled_tree_decode_reads_nothing_back():
    """T > 0 (is_all_greedy False): the sampling walk draws without torch.multinomial's host check;
    the T = 0 request of the batch stays the target's greedy continuation."""
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    worker, toy, rows, bonus, _ = _guarded_worker(1, prompts, [])
    out = _decode(worker, rows, bonus, prompts, 4, sampling=_sampling([0.0, 0.8]))
    assert out[0] == toy.target.reference_greedy(prompts[0], len(out[0]))
    assert len(out[1]) > 4


def test_the_guard_catches_a_reintroduced_sync(monkeypatch):
    """Without the host bound the round sizes the tree mask from the prefix lengths read back to
    the host (the old sync site): the same decode must fail."""
    from ddtree_runtime.sglang_plugin import ddtree_worker as worker_module

    prompts = [[3, 1, 4, 1, 5]]
    worker, _toy, rows, bonus, _ = _guarded_worker(1, prompts, [])
    monkeypatch.setattr(worker_module, "verify_mask_cells", lambda *a: None)
    with pytest.raises(HostRead, match="tolist"):
        _decode(worker, rows, bonus, prompts, 1)


def test_the_commit_leaves_a_reassigned_row_alone():
    """Under overlap a request that finished last round still rides this one, and after the
    verify's reads the scheduler may give its req_to_token row to a new request. The commit must
    move KV between the slots it read before the verify, never write the row."""
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7]]
    worker, toy, rows, bonus, (allocator, _start, _allocated) = _guarded_worker(1, prompts, [])
    r2t = on_host(worker._target_worker.model_runner.req_to_token_pool.req_to_token)
    other = allocator.alloc(64).to(r2t.dtype)
    verify = toy.target_verify

    def verify_then_reassign(plan, cache_loc, req_pool_indices):
        out = verify(plan, cache_loc, req_pool_indices)
        r2t[rows[0], :64] = other  # the scheduler hands row 0 to a new request
        return out

    toy.target_verify = verify_then_reassign
    window = r2t[rows[0], 5 : 5 + WINDOW].clone().long()
    keys_before = toy.target_kv.get_key_buffer(0)[:, 0].clone()
    batch = _overlap_batch(rows, [5, 9], bonus)
    result = worker.forward_batch_generation(batch)
    assert torch.equal(r2t[rows[0], :64], other)  # the new owner's mapping, untouched
    # request 0's accepted nodes' K/V now sit at its window's first slots (read before the verify)
    n = int(on_host(result.accept_lens)[0])
    accepted = on_host(result.next_draft_input.new_seq_lens)[0] - 5
    assert int(accepted) == n
    keys = toy.target_kv.get_key_buffer(0)[:, 0]
    emitted = on_host(result.next_token_ids).view(2, -1)[0, :n].tolist()
    assert [bonus[0], *emitted] == toy.target.reference_greedy(prompts[0], n + 1)
    # committed row k (slot window[k]) holds the K of the token the path took at position 5 + k
    tokens = torch.tensor([bonus[0], *emitted[:-1]])
    want, _ = toy.target.kv_rows(tokens, 5 + torch.arange(n))
    assert torch.allclose(keys[window[:n]], want)
    assert not torch.equal(keys_before[window[:n]], keys[window[:n]])


def test_an_adaptive_worker_switches_widths_between_rounds_reads_nothing_back_and_stays_lossless():
    """Budgets 3 and 7 (``--speculative-ddtree-budget 3,7``): exploration alternates the widths each round,
    so both run inside one batch's life; the round still reads nothing back (its tokens are counted on the
    device; the readback is asynchronous and held off here) and stays the target's greedy continuation."""
    import math

    from ddtree_runtime.core.decoder_settings import DecoderSettings
    from ddtree_runtime.core.round_prices import PriceTable, RoundPrice
    from ddtree_runtime.sglang_plugin.algorithm import PluginSettings
    from ddtree_runtime.sglang_plugin.round.width_choice import WidthChoice
    from tests.sglang.test_tree_decode_worker import _worker as _plain_worker

    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7]]
    settings = PluginSettings(DecoderSettings.resolve("3,7", BLOCK))
    worker, toy, rows, bonus, _ = _plain_worker(1, settings, prompts)
    req_pool = worker._target_worker.model_runner.req_to_token_pool
    req_pool.req_to_token = on_device(req_pool.req_to_token)
    calls: list[str] = []
    verify_rows: list[int] = []  # each round's verify rows per request: its width + 1

    def models(batch):
        guarded = GuardedModels(toy, calls)
        verify = guarded.target_verify

        def target_verify(plan, *args, **kwargs):
            verify_rows.append(int(plan.draft_token_num))
            return verify(plan, *args, **kwargs)

        guarded.target_verify = target_verify
        return guarded

    worker._round_models = models
    prices = PriceTable({(w, b): RoundPrice(0.01, 0.001) for w in ("3", "7") for b in (1, 2)}, "eager", 5)
    choice = WidthChoice((3, 7), prices, torch.device("cpu"), warmup_prefix="warm-")
    choice._next = math.inf  # no readback in these rounds (its copy is a host read on the guard's device)
    choice.tokens = on_device(choice.tokens)
    worker._ddtree_width_choice = choice
    out = _decode(worker, rows, bonus, prompts, 6, calls=calls)
    for p, got in zip(prompts, out, strict=True):
        assert got == toy.target.reference_greedy(p, len(got))
    assert verify_rows == [4, 8] * 3  # the widths alternated, each round verifying its own rows
    emitted = sum(len(o) - 1 for o in out)
    assert int(on_host(choice.tokens).sum()) == emitted  # every emitted token counted on its width
