"""What SGLang's CUDA graphs capture and replay for DDTREE trees, on SGLang's real classes (CPU).

On a GPU with CUDA graphs on (every production profile), the target verify replays a graph captured
once at start-up. Before graph_sites, that graph was DFLASH's: captured without the tree mask on
Triton (siblings saw each other) and with the GDN layers' chain kernels, while the worker reported
every verify as eager. These tests read the decisions from SGLang's own code paths:

* the capture input ``DecodeCudaGraphRunner.get_spec_info`` builds for the target carries the mask
  buffer in tree configurations (and not for the drafter, nor in the chain case);
* SGLang's real ``GDNAttnBackend.__init__`` leaves the target's backend in tree mode;
* a verify reports the target forward's own ``can_run_cuda_graph`` and does not plan the
  attention metadata twice.
The GPU suite (tests/gpu/test_real_server_gpu.py) runs the served result on the H200.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.sglang.conftest import ddtree_argv, resolve

pytestmark = pytest.mark.sglang

WIDTH = 10  # budget 9 + 1


@pytest.fixture
def publish_ddtree(sglang_plugins, tmp_path):
    """Publish a resolved DDTREE record as a scheduler process has it (what the hooks read)."""
    from sglang.srt.runtime_context import publish, reset_context

    from tests.fixtures_models import write_pair

    target, draft = write_pair(tmp_path, "qwen3.6-27b")

    def _publish(*flags: str):
        reset_context()
        record, _ = resolve(ddtree_argv(target, draft, "--disable-radix-cache", *flags))
        publish(record, role="scheduler")
        return record

    yield _publish
    reset_context()


TREE = ("--speculative-ddtree-budget", "9")
CHAIN = ("--speculative-ddtree-budget", "15", "--speculative-ddtree-topk-cap", "1")


def _capture_input(*, is_draft_worker: bool):
    """``DecodeCudaGraphRunner.get_spec_info`` (SGLang's code) on a runner holding what it reads."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.speculative.spec_registry import get_spec

    mask_buffer = torch.ones(4 * WIDTH * (64 + WIDTH), dtype=torch.uint8)
    runner = SimpleNamespace(
        model_runner=SimpleNamespace(
            spec_algorithm=get_spec("DDTREE"),
            is_draft_worker=is_draft_worker,
            attn_backend=object.__new__(TritonAttnBackend),
        ),
        buffers=SimpleNamespace(custom_mask=mask_buffer),
        captured_req_width=WIDTH,
        _capture_ragged_verify_layout=lambda num_tokens: None,
    )
    return DecodeCudaGraphRunner.get_spec_info(runner, 4 * WIDTH), mask_buffer


def test_target_verify_graphs_are_captured_with_the_tree_mask(publish_ddtree):
    publish_ddtree(*TREE)
    spec_info, mask_buffer = _capture_input(is_draft_worker=False)
    # Triton compiles USE_CUSTOM_MASK from this at capture: None would bake a causal verify in.
    assert spec_info.custom_mask is mask_buffer
    assert spec_info.draft_token_num == WIDTH


def test_the_drafter_and_the_chain_case_keep_dflashs_maskless_capture(publish_ddtree):
    publish_ddtree(*TREE)
    draft_info, _ = _capture_input(is_draft_worker=True)
    assert draft_info.custom_mask is None  # the drafter's block is not a tree
    publish_ddtree(*CHAIN)
    chain_info, _ = _capture_input(is_draft_worker=False)
    assert chain_info.custom_mask is None  # DFLASH's own decode: its causal verify is right


def _gdn_backend(record):
    """SGLang's real ``GDNAttnBackend.__init__`` (plugin hooks applied) on a hybrid pool."""
    from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
    from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend

    from tests.sglang._hybrid_toy import make_hybrid_pool

    triton = LinearAttnKernelBackend.TRITON
    runner = SimpleNamespace(
        server_args=record, device="cpu", is_draft_worker=False, token_to_kv_pool=None,
        req_to_token_pool=make_hybrid_pool(rows=4, context=64, scratch_rows=WIDTH),
        linear_attn_backends=SimpleNamespace(decode=triton, prefill=triton, verify=triton),
    )  # fmt: skip
    return GDNAttnBackend(runner)


def test_the_gdn_backend_is_in_tree_mode_from_construction(publish_ddtree):
    from ddtree_runtime.sglang_plugin.refusals.worker_start import check_tree_graphs

    backend = _gdn_backend(publish_ddtree(*TREE))
    # Read by the capture (_capture_metadata: tree kernels + link buffers) and every replay.
    assert backend.topk >= 2
    check_tree_graphs(SimpleNamespace(attn_backend=SimpleNamespace(linear_attn_backend=backend)))


def test_the_chain_case_keeps_the_gdn_chain_kernels_and_a_tree_on_them_is_refused(publish_ddtree):
    from ddtree_runtime.sglang_plugin.refusals.worker_start import TreeGraphsNotCaptured, check_tree_graphs

    backend = _gdn_backend(publish_ddtree(*CHAIN))
    assert backend.topk <= 1
    with pytest.raises(TreeGraphsNotCaptured, match="verify every tree as a chain"):
        check_tree_graphs(SimpleNamespace(attn_backend=SimpleNamespace(linear_attn_backend=backend)))


def test_a_verify_reports_the_forwards_own_graph_answer_and_plans_once(monkeypatch):
    """``SGLangRoundModels.target_verify`` with DFlash's ``prepare_for_verify`` standing for a batch it
    loaded into a graph: the forward gets the batch as loaded (no eager override, no second
    metadata plan) and the round reports what the forward says."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from ddtree_runtime.sglang_plugin.ddtree_info import DDTreeVerifyInput
    from ddtree_runtime.sglang_plugin.round.sglang_models import SGLangRoundModels
    from ddtree_runtime.sglang_plugin.round.tree_step import plan_tree_verify

    loaded = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, can_run_decode_cuda_graph=True)
    monkeypatch.setattr(DDTreeVerifyInput, "prepare_for_verify", lambda self, batch, worker: (loaded, True))
    calls = []

    def forward_batch_generation(**kwargs):
        calls.append(kwargs)
        rows = 2 * WIDTH
        return SimpleNamespace(
            can_run_cuda_graph=True,
            logits_output=SimpleNamespace(
                next_token_logits=torch.zeros(rows, 32), hidden_states=torch.zeros(rows, 8)
            ),
        )

    translator = SimpleNamespace(plan=lambda **kw: None)
    worker = SimpleNamespace(
        target_worker=SimpleNamespace(
            model_runner=SimpleNamespace(kv_index_translator=translator, attn_backend=None),
            forward_batch_generation=forward_batch_generation,
        ),
        _target_logits_processor=None,
    )
    batch = SimpleNamespace(seq_lens=torch.tensor([5, 7]), seq_lens_cpu=torch.tensor([5, 7]), seq_lens_sum=12,
                            sampling_info=None, out_cache_loc=None)  # fmt: skip
    torch.manual_seed(0)
    plan = plan_tree_verify(torch.randn(2, 4, 32), torch.tensor([1, 2]), batch.seq_lens, WIDTH - 1)
    models = SGLangRoundModels(worker, batch)
    models.target_verify(plan, torch.arange(2 * WIDTH), torch.tensor([0, 1]))
    (call,) = calls
    assert call["forward_batch"] is loaded and loaded.can_run_decode_cuda_graph is True
    assert call["skip_attn_backend_init"] is True  # prepare_for_verify planned it (graph or eager)
    assert models.last_target_out.can_run_cuda_graph is True


@pytest.mark.parametrize("replayed", [True, False])
def test_the_workers_result_carries_the_verifys_graph_answer(replayed):
    """SGLang counts graph replays from ``GenerationBatchResult.can_run_cuda_graph``; the worker
    reported False for every tree verify before, hiding a replay."""
    from tests.sglang.test_tree_decode_worker import _batch, _settings, _worker

    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7]]
    worker, toy, rows, bonus, _ = _worker(1, _settings(), prompts)
    verify = toy.target_verify

    def target_verify(*args, **kwargs):
        toy.last_target_out = SimpleNamespace(can_run_cuda_graph=replayed, logits_output=None)
        return verify(*args, **kwargs)

    toy.target_verify = target_verify
    result = worker.forward_batch_generation(_batch(rows, [len(p) for p in prompts], bonus))
    assert result.can_run_cuda_graph is replayed


# --- the seams (docs/sglang-plugin-sites.md, "CUDA graphs"): what graph_sites and the round rely on -----
CGR = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
TRITON = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend"
MAMBA = "sglang.srt.layers.attention.hybrid_linear_attn_backend.MambaAttnBackendBase"
GRAPH_SEAMS = [
    ("sglang.srt.speculative.dflash_utils.resolve_dflash_verify_mask_policy",
     ["backend_name not in _DFLASH_VERIFY_SKIP_CUSTOM_MASK_BACKENDS"], "0f97e1d209192932"),
    (f"{CGR}.get_spec_info",
     ["resolve_dflash_verify_mask_policy(", "not build_custom_mask", "else self.buffers.custom_mask"],
     "5c7a1ebef1771e97"),
    (f"{CGR}.can_run_graph",
     ["spec_info.num_tokens_per_req != self.captured_req_width", "if self.require_mlp_sync:"],
     "04eea97fa5b2b0a1"),
    (f"{TRITON}._update_target_verify_buffers",
     ["custom_mask[: spec_info.custom_mask.shape[0]] = spec_info.custom_mask",
      "seq_mask_len = num_tokens_per_req * (seq_lens + num_tokens_per_req)"], "e37fbbefcd82e396"),
    (f"{TRITON}._build_cuda_graph_forward_metadata",
     ["and spec_info.custom_mask is not None"], "e1667e542cc2f479"),
    (f"{MAMBA}._capture_metadata",
     ["if forward_mode.is_target_verify() and self.topk > 1:",
      "retrieve_next_token=self.retrieve_next_token_list[bs - 1]"], "90dfb855f51c6bc7"),
    (f"{MAMBA}._replay_metadata",
     ["if is_target_verify and self.topk > 1:",
      "self.retrieve_next_token_list[bs - 1][:bs_without_pad].copy_("], "537067e207f75025"),
    ("sglang.srt.speculative.dflash_info.DFlashVerifyInput.prepare_for_verify",
     ["decode_cuda_graph_runner.load_batch(", "can_run_graph(", "attn_backend.init_forward_metadata("],
     "cfe1f10b4da6169c"),
    ("sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.init_cuda_graphs",
     ["self._draft_sampler = self._maybe_build_draft_sampler()"], "63c10712f6a17fd4"),
    ("sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation",
     ["forward_batch.apply_deprecated_skip_attn_backend_init(skip_attn_backend_init)",
      "logits_output, can_run_cuda_graph = out.logits_output, out.can_run_graph"], "074f2a1c07948223"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "snippets", "digest"), GRAPH_SEAMS, ids=[s[0].rsplit(".", 2)[-1] for s in GRAPH_SEAMS]
)
def test_graph_seam_is_what_the_plugin_was_written_against(path, snippets, digest):
    import hashlib

    from tests.sglang.test_hybrid_sites import _source

    source = _source(path)
    for snippet in snippets:
        assert snippet in source, f"{path} no longer contains {snippet!r}: re-audit the CUDA-graph seam"
    got = hashlib.sha256(source.encode()).hexdigest()[:16]
    assert got == digest, f"{path} changed (sha256 {got}): re-audit it, then update GRAPH_SEAMS"
