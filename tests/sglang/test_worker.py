"""Worker selection, the start-up width check and the after-every-forward hidden-state guard."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from ddtree_runtime.core.decoder_settings import DecoderSettings
from tests.sglang.conftest import ddtree_argv, resolve

pytestmark = pytest.mark.sglang


def test_create_worker_selects_the_ddtree_worker_on_dflash_v2(sglang_plugins, pair):
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from ddtree_runtime.sglang_plugin.ddtree_worker import DDTreeWorker

    record, _ = resolve(ddtree_argv(*pair))
    worker_cls = sglang_plugins.from_string("DDTREE").create_worker(record)
    assert worker_cls is DDTreeWorker
    assert issubclass(worker_cls, DFlashWorkerV2)
    # DFLASH still gets SGLang's own worker
    assert sglang_plugins.DFLASH.create_worker(record) is DFlashWorkerV2


def test_worker_start_fails_on_a_width_mismatch_before_touching_the_gpu(sglang_plugins, pair, tmp_path):
    from ddtree_runtime.core.model_files import ContractError
    from ddtree_runtime.sglang_plugin.ddtree_worker import DDTreeWorker
    from tests.fixtures_models import write_pair

    record, _ = resolve(ddtree_argv(*pair))
    # the drafter on disk changes after resolution (a redeploy swapped the checkpoint)
    _, bad_draft = write_pair(tmp_path / "bad", "qwen3-8b", fc_shape=(4096, 5120))
    from sglang.srt.arg_groups.overrides import declare_resolution

    declare_resolution(record, "test", speculative_draft_model_path=str(bad_draft))
    target_worker = SimpleNamespace(forward_batch_generation=lambda *a, **k: None)
    with pytest.raises(ContractError) as exc:
        DDTreeWorker(record, gpu_id=0, nccl_port=0, target_worker=target_worker)
    assert exc.value.cause == "fc_width_mismatch"
    assert "[N, 5120]" in str(exc.value) and "[N, 20480]" in str(exc.value)


def test_worker_refuses_to_start_without_resolved_ddtree_settings(sglang_plugins, pair):
    from ddtree_runtime.sglang_plugin.ddtree_worker import DDTreeWorker
    from ddtree_runtime.sglang_plugin.refusals.resolution import DDTreeConfigError

    argv = ddtree_argv(*pair)
    argv[argv.index("DDTREE")] = "DFLASH"
    record, _ = resolve(argv)
    with pytest.raises(DDTreeConfigError, match="resolved settings"):
        DDTreeWorker(record, gpu_id=0, nccl_port=0, target_worker=SimpleNamespace())


class _TargetWorker:
    """Stands in for TpModelWorker.forward_batch_generation's return value only."""

    def __init__(self, hidden):
        self.hidden = hidden
        self.calls = 0

    def forward_batch_generation(self, batch=None, forward_batch=None, capture_hidden_mode=None, **_):
        self.calls += 1
        return SimpleNamespace(logits_output=SimpleNamespace(hidden_states=self.hidden))


def _guarded(pair, hidden):
    from ddtree_runtime.core.contract import load_contract
    from ddtree_runtime.sglang_plugin.algorithm import PluginSettings
    from ddtree_runtime.sglang_plugin.handshake import HandshakeState, static_handshake
    from ddtree_runtime.sglang_plugin.hidden_guard import guard_target_forward

    contract = load_contract(*pair)
    settings = PluginSettings(DecoderSettings(15, 16), contract=contract.to_dict())
    state = HandshakeState(static_handshake(settings))
    seen = []
    target = _TargetWorker(hidden)
    forward = guard_target_forward(target.forward_batch_generation, contract, state, seen.append)
    return forward, state, seen, target


def _full_mode():
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    return CaptureHiddenMode.FULL


def test_guard_passes_the_right_width_and_records_the_handshake(sglang_plugins, pair):
    forward, state, seen, _ = _guarded(pair, torch.zeros(7, 20480))
    batch = SimpleNamespace(extend_lens=[3, 4])
    forward(batch, capture_hidden_mode=_full_mode())
    assert state.to_dict()["status"] == "ok" and state.to_dict()["observed_hidden_width"] == 20480
    assert seen[-1]["status"] == "ok"


def test_guard_fails_on_the_field_failure_width(sglang_plugins, pair):
    from ddtree_runtime.core.model_files import ContractError

    forward, state, _, _ = _guarded(pair, torch.zeros(7, 4096))  # [N, H] instead of [N, 5H]
    with pytest.raises(ContractError, match=r"expects \[N, 20480\].*got \[N, 4096\]") as exc:
        forward(SimpleNamespace(extend_lens=[7]), capture_hidden_mode=_full_mode())
    assert exc.value.cause == "hidden_width_mismatch"
    assert state.to_dict()["status"] == "mismatch"


def test_guard_fails_on_missing_hidden_states(sglang_plugins, pair):
    from ddtree_runtime.core.model_files import ContractError

    forward, state, _, _ = _guarded(pair, None)
    with pytest.raises(ContractError) as exc:
        forward(SimpleNamespace(extend_lens=[2]), capture_hidden_mode=_full_mode())
    assert exc.value.cause == "hidden_states_missing"
    assert state.to_dict()["status"] == "missing"


def test_guard_checks_the_verify_row_count(sglang_plugins, pair):
    from ddtree_runtime.core.model_files import ContractError

    forward, _, _, _ = _guarded(pair, torch.zeros(32, 20480))
    verify = SimpleNamespace(
        input_ids=torch.zeros(2 * 17, dtype=torch.long), capture_hidden_mode=_full_mode()
    )
    with pytest.raises(ContractError, match="34 tokens"):
        forward(batch=None, forward_batch=verify, is_verify=True)


def test_guard_ignores_forwards_that_feed_no_drafter(sglang_plugins, pair):
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    forward, state, _, target = _guarded(pair, None)
    forward(SimpleNamespace(extend_lens=[3]), capture_hidden_mode=CaptureHiddenMode.NULL)
    forward(SimpleNamespace(extend_lens=[]), capture_hidden_mode=_full_mode())  # idle rank
    assert target.calls == 2 and state.to_dict()["status"] == "pending"


def test_tree_configurations_pass_the_start_check_and_chains_always_do(sglang_plugins, pair):
    from ddtree_runtime.sglang_plugin.refusals.worker_start import check_tree_decode_support, is_chain

    tree, tree_cfg = resolve(ddtree_argv(*pair, "--speculative-ddtree-budget", "24"))
    assert not is_chain(tree._ddtree_resolved)
    check_tree_decode_support(tree._ddtree_resolved, tree_cfg)  # the tree round serves it
    chain, _ = resolve(
        ddtree_argv(*pair, "--speculative-ddtree-topk-cap", "1", "--speculative-ddtree-budget", "15")
    )
    assert is_chain(chain._ddtree_resolved)
    check_tree_decode_support(chain._ddtree_resolved, SimpleNamespace(enable_dp_attention=True))


def test_tree_configurations_the_round_cannot_serve_are_refused_with_the_reason(sglang_plugins, pair):
    from ddtree_runtime.sglang_plugin.ddtree_worker import DDTreeWorker
    from ddtree_runtime.sglang_plugin.refusals.worker_start import TreeDecodeNotAvailable

    record, _ = resolve(
        ddtree_argv(*pair, "--speculative-ddtree-budget", "24", "--speculative-draft-window-size", "64")
    )
    with pytest.raises(TreeDecodeNotAvailable) as exc:
        DDTreeWorker(record, gpu_id=0, nccl_port=0, target_worker=SimpleNamespace())
    text = str(exc.value)
    assert "--speculative-draft-window-size" in text and "budget 24" in text
    assert "--speculative-ddtree-topk-cap 1 --speculative-ddtree-budget 15" in text


def test_worker_features_a_tree_cannot_use_are_refused(sglang_plugins, pair):
    from ddtree_runtime.sglang_plugin.refusals.worker_start import (
        TreeDecodeNotAvailable,
        check_tree_worker_features,
    )

    record, _ = resolve(ddtree_argv(*pair, "--speculative-ddtree-budget", "24"))
    settings = record._ddtree_resolved
    with pytest.raises(TreeDecodeNotAvailable, match="selector draft head"):
        check_tree_worker_features(settings, SimpleNamespace(selector=object()))
    check_tree_worker_features(settings, SimpleNamespace(_need_mamba_verify_commit=False, selector=None))
    chain = replace(settings, decoder=DecoderSettings.chain(settings.decoder.block_size))
    check_tree_worker_features(chain, SimpleNamespace(_need_mamba_verify_commit=True))  # DFlash's decode


@pytest.mark.parametrize(("layer_ids", "cause", "detail"), [
    (None, "hidden_width_mismatch", "(expected width 128, got 64)"),  # no capture: the last hidden state
    ([1, 3], "hidden_width_mismatch", "(expected width 192, got 128)"),  # a drafter for another target
])  # fmt: skip
def test_the_loaded_width_check_speaks_the_rollouts_diagnosis(layer_ids, cause, detail):
    """What the loaded-model check raises at start reaches the rollout through the unit's journal: the
    diagnosis (health/diagnose.scan) must name the cause and both widths, not a bare crash loop."""
    from ddtree_runtime.core.model_files import ContractError
    from ddtree_runtime.health.diagnose import scan
    from ddtree_runtime.sglang_plugin.algorithm import PluginSettings
    from ddtree_runtime.sglang_plugin.refusals.worker_start import loaded_contract

    runner = SimpleNamespace(
        model_config=SimpleNamespace(hidden_size=64, num_hidden_layers=4),
        spec_aux_config=SimpleNamespace(dflash_target_layer_ids=layer_ids),
    )
    fc_in = 128 if layer_ids is None else 192
    draft = SimpleNamespace(fc=torch.nn.Linear(fc_in, 32), config=SimpleNamespace(hidden_size=32))
    with pytest.raises(ContractError) as raised:
        loaded_contract(runner, draft, PluginSettings(DecoderSettings(15, 16, None)))
    journal = f"Dec 06 01:02:03 ct129 python[812]: ContractError: {raised.value}\n"
    findings = scan(journal)
    assert [f.cause for f in findings] == [cause], findings
    assert detail in findings[0].summary, findings[0].summary
