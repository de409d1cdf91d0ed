"""Start-up refusals, through SGLang's real resolution pipeline (the hybrid gate: test_hybrid_gates.py)."""

from __future__ import annotations

import pytest

from tests.sglang.conftest import ddtree_argv, resolve

pytestmark = pytest.mark.sglang


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all"], "does not support LoRA"),
        (["--enable-layernorm-sp"], "--enable-layernorm-sp"),
        (["--enable-hierarchical-cache"], "--enable-hierarchical-cache"),
        (["--enable-unified-memory"], "--enable-unified-memory"),
        (["--enable-linear-replayssm-spec"], "--enable-linear-replayssm-spec"),
        (["--disaggregation-mode", "prefill"], "colocated only"),
        (["--attention-backend", "flashinfer"], "--attention-backend is 'flashinfer'"),
        (["--attention-backend", "torch_native"], "Use --attention-backend triton"),
        (["--decode-attention-backend", "flashinfer"], "--decode-attention-backend is 'flashinfer'"),
    ],
)
def test_refused_configuration_names_the_flag(sglang_plugins, pair, flags, message):
    with pytest.raises(Exception, match="DDTREE") as exc:
        resolve(ddtree_argv(*pair, *flags))
    assert message in str(exc.value)


def test_block_verification_is_refused_by_sglang_itself(sglang_plugins, pair):
    """speculative_hook.py:176 runs before the plugin's resolver and already names the algorithms."""
    with pytest.raises(ValueError, match="--speculative-use-block-verification only supports EAGLE"):
        resolve(ddtree_argv(*pair, "--speculative-use-block-verification"))


def test_derived_cp_tp_group_sharing_is_refused(sglang_plugins, pair):
    """No CLI flag: SGLang derives it from the architecture (GLM-5.3 hybrids), so check the
    resolved view of a real record with the derived value declared."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
    from sglang.srt.server_args import prepare_server_args

    from ddtree_runtime.sglang_plugin.refusals.resolution import DDTreeConfigError, check_refusals

    record = prepare_server_args(ddtree_argv(*pair, "--attention-backend", "triton"))
    check_refusals(resolving_view(record))  # nothing refused by default
    declare_resolution(record, "test", enable_cp_tp_group_sharing=True)
    with pytest.raises(DDTreeConfigError, match="--enable-cp-tp-group-sharing"):
        check_refusals(resolving_view(record))


def test_all_refusals_are_reported_at_once(sglang_plugins, pair):
    from ddtree_runtime.sglang_plugin.refusals.resolution import DDTreeConfigError

    with pytest.raises(DDTreeConfigError) as exc:
        resolve(ddtree_argv(*pair, "--enable-layernorm-sp", "--attention-backend", "flashinfer"))
    text = str(exc.value)
    assert "--enable-layernorm-sp" in text and "'flashinfer'" in text
