"""Process-wide test set-up, for every test directory."""

from __future__ import annotations

import importlib.util
import subprocess

import pytest

if importlib.util.find_spec("torch") is not None:
    # The fleet tests load Ansible's inventory API in-process, and Ansible replaces sys.intern
    # with a callable object. torch._dynamo, imported later through SGLang/transformers, then
    # refuses to register its polyfill for it (TypeError: substitute_in_graph expects a function).
    # Importing dynamo first, while sys.intern is still the builtin, keeps both working. Its
    # import pulls torchvision where installed; the sglang environment's CPU workaround comes first.
    if importlib.util.find_spec("torchvision") is not None:
        from tests.sglang._cpu_env import define_torchvision_op_schemas

        define_torchvision_op_schemas()
    import torch._dynamo  # noqa: F401


# --- parallel run (issue 24): scripts/test.sh runs pytest-xdist (-n N --dist loadgroup
# --no-loadscope-reorder). The unit of scheduling is a group, run whole, in file order, by one worker:
# a module (its module fixtures are set up once), or the modules named together in SHARED_WORLDS, which
# share what they deploy on one lab (tests/lab: build A installed once on ct129/ct130 serves them all).
# Each worker has a lab of its own (tests/lab/conftest.py), so groups on different workers never share
# hosts. The groups reach xdist through this scheduler, not xdist_group marks: xdist 3.8 marks a group
# by rewriting `item._nodeid`, which pytest 9 no longer reads, so its loadgroup silently runs every
# test on its own.
SHARED_WORLDS = {
    "tests/lab/test_canary_lab.py": "lab-engine",
    "tests/lab/test_deploy_rollout.py": "lab-engine",
    "tests/lab/test_fleet_lab.py": "lab-engine",
    "tests/lab/test_plan_lab.py": "lab-engine",
}
# Groups start longest first (docs/ci-time.md has the figures): a long group started last would leave the
# other worker idle at the end. Every other group follows in collection order.
LONGEST_FIRST = ("lab-engine", "tests/lab/test_real_sglang_lab.py", "tests/sglang/test_real_server.py")


def group_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return SHARED_WORLDS.get(path, path)


# --- the fast loop (issue 32): `make check` runs `-m "not slow"` (docs/testing.md). These modules start no
# process and need no lab, no SGLang server and no Triton interpreter; every other test is marked slow
# here. A test in them that starts a process fails (`_fast_tests_start_no_process`), so the list cannot
# quietly turn slow; a new fast module is added here.
FAST_MODULES = frozenset(f"tests/unit/{name}.py" for name in (
    "test_contract", "test_controller_tasks", "test_counterfactual", "test_counterfactual_hook",
    "test_decoder_settings", "test_evidence", "test_width_policy", "test_adaptive_width_figures",
    "test_import_graph", "test_lab_base", "test_tree_order", "test_tiny_engine", "test_tiny_hf_tokenizer",
    "test_lab_packages", "test_lossless", "test_metrics_exporter_role", "test_parallel_run",
    "test_plugin_map", "test_plugin_warmup", "test_profile_choice", "test_readiness", "test_report_file",
    "test_role_variables", "test_server_info_reader", "test_planner_widths", "test_budget_inputs",
    "test_width_state", "test_fleet_widths",
    "test_roles_argspec", "test_round_prices",
    "test_rollout_layout", "test_rollout_reads",
    "test_server_bench", "test_tree_build", "test_tree_cli", "test_tree_commit", "test_tree_dispatch",
    "test_tree_sampling", "test_tree_verify", "test_tune",
))  # fmt: skip


@pytest.fixture(autouse=True)
def _fast_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("slow") is not None:
        return

    def refuse(self: subprocess.Popen, args: object, *rest: object, **kwargs: object) -> None:
        raise AssertionError(f"{request.node.nodeid} starts a process ({args!r}): a fast test may not; "
                             "move it to a module outside tests/conftest.py's FAST_MODULES")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


def pytest_itemcollected(item: pytest.Item) -> None:
    if item.nodeid.split("::", 1)[0] not in FAST_MODULES:
        item.add_marker(pytest.mark.slow)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Every worker sorts the same collection the same way, as xdist requires.
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(group_of(item.nodeid), len(rank)))  # stable: file order kept


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: absent without it (-p no:xdist)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorldScheduling(LoadScopeScheduling):
        """loadscope's scheduling (a scope runs whole on one worker), with the groups above as scopes."""

        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return WorldScheduling(config, log)
