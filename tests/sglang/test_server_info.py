"""The handshake in /server_info (through SGLang's real builders) and the sglang:ddtree_* metrics."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tests.sglang.conftest import ddtree_argv, resolve

pytestmark = pytest.mark.sglang

HANDSHAKE_KEYS = {
    "algorithm", "budget", "topk_cap", "block_size", "target_hidden_size", "target_layer_ids",
    "expected_hidden_width", "draft_fc_in_features", "target_hybrid", "observed_hidden_width", "status",
}


def test_server_info_carries_flags_and_the_launch_handshake(sglang_plugins, pair):
    from sglang.srt.utils import common

    from ddtree_runtime.sglang_plugin import server_info

    server_info._latest_live = None
    record, _ = resolve(ddtree_argv(*pair, "--speculative-ddtree-budget", "16"))
    info = common.build_server_info(record, {"max_total_num_tokens": 1})
    assert info["speculative_algorithm"] == "DDTREE"
    assert info["speculative_num_draft_tokens"] == 17
    assert info["speculative_dflash_block_size"] == 16
    assert info["speculative_ddtree_budget"] == 16
    assert info["speculative_ddtree_topk_cap"] is None
    from ddtree_runtime import __version__

    assert info["ddtree_runtime_version"] == __version__  # which build serves (the canary compares it)
    hs = info["ddtree_handshake"]
    assert set(hs) == HANDSHAKE_KEYS
    assert hs["algorithm"] == "DDTREE" and hs["budget"] == 16 and hs["block_size"] == 16
    assert hs["target_hidden_size"] == 4096 and hs["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert hs["expected_hidden_width"] == 20480 == hs["draft_fc_in_features"]
    assert hs["observed_hidden_width"] is None and hs["status"] == "pending"
    assert info["ddtree_overlap_schedule"] is True and info["disable_overlap_schedule"] is False


def test_server_info_says_whether_the_scheduler_runs_overlapped(sglang_plugins, pair):
    from sglang.srt.utils import common

    from ddtree_runtime.health.sglang_client import read_server_info

    def overlap_schedule(info: dict) -> bool | None:
        return read_server_info(info).overlap_schedule

    record, _ = resolve(ddtree_argv(*pair, "--disable-overlap-schedule"))
    info = common.build_server_info(record, {})
    assert info["ddtree_overlap_schedule"] is False
    assert overlap_schedule(info) is False
    record, _ = resolve(ddtree_argv(*pair))
    info = common.build_server_info(record, {})
    assert info["ddtree_overlap_schedule"] is True
    assert overlap_schedule(info) is True  # what the live probe's report carries
    assert overlap_schedule({"disable_overlap_schedule": False}) is True  # a DFLASH server
    assert overlap_schedule({}) is None


def test_dflash_server_info_has_no_ddtree_keys(sglang_plugins, pair):
    from sglang.srt.utils import common

    argv = ddtree_argv(*pair)
    argv[argv.index("DDTREE")] = "DFLASH"
    record, _ = resolve(argv)
    info = common.build_server_info(record, {})
    assert "ddtree_handshake" not in info and "speculative_ddtree_budget" not in info


def test_live_handshake_travels_from_scheduler_state_to_server_info(sglang_plugins, pair):
    from sglang.srt.managers.scheduler_components.internal_state import SchedulerInternalStateController
    from sglang.srt.managers.tokenizer_control_mixin import TokenizerControlMixin
    from sglang.srt.utils import common

    from ddtree_runtime.sglang_plugin import server_info

    live = {"status": "ok", "observed_hidden_width": 20480, "budget": 16}
    # scheduler side: SGLang's own _add_speculative, hooked
    controller = object.__new__(SchedulerInternalStateController)
    controller.scheduler = SimpleNamespace(
        spec_algorithm=sglang_plugins.from_string("DDTREE"),
        draft_worker=SimpleNamespace(ddtree_handshake=lambda: dict(live)),
        metrics_reporter=SimpleNamespace(spec_total_num_forward_ct=4, spec_total_num_accept_tokens=18),
    )
    state: dict = {}
    controller._add_speculative(state)
    assert state["avg_spec_accept_length"] == 4.5
    assert state["ddtree_handshake"] == live
    # HTTP side: the hooked tokenizer-manager call remembers it, build_server_info reports it
    assert hasattr(TokenizerControlMixin.get_internal_state, "__wrapped__")

    async def scheduler_reply(*_a, **_k):
        return [state]

    server_info._latest_live = None
    asyncio.run(server_info.remember_live_handshake(scheduler_reply))
    record, _ = resolve(ddtree_argv(*pair))
    assert common.build_server_info(record, {})["ddtree_handshake"] == live
    server_info._latest_live = None


def test_metrics_are_exported_under_sglang_ddtree_names():
    from prometheus_client import CollectorRegistry, generate_latest

    from ddtree_runtime.sglang_plugin.handshake import METRIC_NAMES, HandshakeMetrics

    registry = CollectorRegistry()
    metrics = HandshakeMetrics(registry=registry)
    metrics.update({"expected_hidden_width": 25600, "observed_hidden_width": 5120, "budget": 22})
    text = generate_latest(registry).decode()
    assert "sglang:ddtree_expected_hidden_width 25600.0" in text
    assert "sglang:ddtree_observed_hidden_width 5120.0" in text
    assert "sglang:ddtree_budget 22.0" in text
    assert len(METRIC_NAMES) == 3
