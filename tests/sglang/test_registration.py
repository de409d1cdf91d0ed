"""Registration through the installed project's ``sglang.srt.plugins`` entry point."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang
REPO = Path(__file__).resolve().parents[2]


def test_entry_point_is_declared_by_the_installed_distribution():
    eps = [ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins") if ep.name == "ddtree"]
    assert len(eps) == 1, "ddtree-runtime must be pip-installed (editable is fine) in this venv"
    assert eps[0].value == "ddtree_runtime.sglang_plugin:register"
    assert eps[0].dist is not None and eps[0].dist.name == "ddtree-runtime"


def test_sglang_is_the_pinned_release():
    import sglang

    from ddtree_runtime.sglang_plugin import PINNED_SGLANG_VERSION

    assert sglang.__version__ == PINNED_SGLANG_VERSION


def test_load_plugins_registers_ddtree_as_dflash_family(sglang_plugins):
    from ddtree_runtime.sglang_plugin.algorithm import DDTreeSpecAlgo

    algo = sglang_plugins.from_string("ddtree")
    assert isinstance(algo, DDTreeSpecAlgo)
    assert algo is sglang_plugins.from_string("DDTREE")  # one registered instance
    assert algo.is_speculative() and algo.is_some() and not algo.is_none()
    # the capability predicates SGLang gates capture, pools, CUDA graphs and scheduling on
    dflash = sglang_plugins.DFLASH
    for name in (
        "is_dflash_family", "is_dflash", "supports_target_verify_for_draft",
        "supports_prefill_shared_read_done", "has_draft_kv", "is_eagle", "is_eagle3",
        "is_standalone", "is_ngram", "is_dspark", "is_uno", "is_frozen_kv_mtp", "need_topk",
        "carries_draft_hidden_states",
    ):
        assert getattr(algo, name)() == getattr(dflash, name)(), name
    # deliberate differences (docs/sglang-plugin-sites.md)
    assert dflash.supports_mixed_chunk() and not algo.supports_mixed_chunk()
    assert dflash.supports_grammar_overlap() and not algo.supports_grammar_overlap()


def test_every_enum_predicate_is_answered_by_ddtree(sglang_plugins):
    algo = sglang_plugins.from_string("DDTREE")
    predicates = [n for n in vars(sglang_plugins) if n.startswith(("is_", "supports_"))]
    assert predicates
    for name in predicates:
        assert name in type(algo).__dict__ or hasattr(algo, name), name


def test_second_register_call_is_a_no_op(sglang_plugins):
    from ddtree_runtime.sglang_plugin import register

    before = sglang_plugins.from_string("DDTREE")
    register()
    assert sglang_plugins.from_string("DDTREE") is before


def test_other_sglang_release_is_refused_with_a_clear_message():
    from ddtree_runtime.sglang_plugin.registration import UnsupportedSGLangVersion, check_sglang_version

    expected = r"sglang==0\.5\.23.*this environment has sglang 0\.5\.22"
    with pytest.raises(UnsupportedSGLangVersion, match=expected):
        check_sglang_version("0.5.22")


def _run_sglang_process(plugins: str | None) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(
        """
        from tests.sglang._cpu_env import define_torchvision_op_schemas
        define_torchvision_op_schemas()
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        try:
            print("ALGO", type(SpeculativeAlgorithm.from_string("DDTREE")).__name__)
        except ValueError as exc:
            print("ERROR", exc)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    if plugins is not None:
        env["SGLANG_PLUGINS"] = plugins
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def test_fresh_process_finds_ddtree_only_through_the_entry_point():
    allowed = _run_sglang_process("ddtree")
    assert "ALGO DDTreeSpecAlgo" in allowed.stdout, allowed.stderr[-2000:]
    skipped = _run_sglang_process("some_other_plugin")
    assert "ERROR Unknown speculative algorithm name: DDTREE" in skipped.stdout, skipped.stderr[-2000:]


def test_ddtree_answers_every_instance_method_the_scheduler_may_call_on_an_algorithm(sglang_plugins):
    """SGLang calls enum methods on whatever algorithm runs (e.g. ``create_future_map`` in
    ``Scheduler.init_overlap``); 0.5.23's CustomSpecAlgo lacks some, which crashed the real scheduler."""
    import inspect

    algo = sglang_plugins.from_string("DDTREE")
    enum_methods = {
        name for name, member in vars(sglang_plugins).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }  # fmt: skip
    classmethods = {"from_string", "register", "get_platform_worker_cls"}
    missing = sorted(m for m in enum_methods - classmethods if not callable(getattr(algo, m, None)))
    assert missing == []


def test_ddtree_builds_the_dflash_family_future_map(sglang_plugins):
    from types import SimpleNamespace

    import torch

    algo = sglang_plugins.from_string("DDTREE")
    pool = SimpleNamespace(req_to_token=torch.zeros(4, 8, dtype=torch.int32), size=4)
    future_map = algo.create_future_map(torch.device("cpu"), pool, needs_cpu_seq_lens=False)
    assert type(future_map).__name__ == "FutureMap"
