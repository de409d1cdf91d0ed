"""The plugin's start-up warm-up (``sglang_plugin.warmup``): which batch sizes it runs, where it is
added to ``--warmups``. The run itself is the GPU suite's (no kernel compiles after readiness)."""

from __future__ import annotations

from ddtree_runtime.sglang_plugin import warmup


def test_it_warms_every_captured_batch_size_the_server_can_run():
    # each captured size, and one smaller that pads into it
    assert warmup.warmup_sizes([16, 1, 4, 2, 8, 32], 16) == [1, 2, 3, 4, 7, 8, 15, 16]
    assert warmup.warmup_sizes(None, 4) == [1, 2, 3, 4]
    assert warmup.warmup_sizes([8, 16], 4) == [3, 4]  # nothing captured below the limit: the limit
    assert warmup.warmup_sizes([2, 1], None) == [1, 2]


def test_it_is_added_once_after_the_operators_own_warmups():
    assert warmup.with_warmup(None) == warmup.NAME
    assert warmup.with_warmup("voice_chat") == f"voice_chat,{warmup.NAME}"
    assert warmup.with_warmup(f"{warmup.NAME},voice_chat") == f"{warmup.NAME},voice_chat"


def test_it_runs_on_cuda_with_graphs_only():
    assert warmup.wanted("cuda", False)
    assert warmup.wanted("cuda:1", False)
    assert not warmup.wanted("cuda", True)  # no graphs captured: nothing per batch size to warm
    assert not warmup.wanted("cpu", False)  # the CPU lab: it would only lengthen every start
    assert not warmup.wanted(None, False)
