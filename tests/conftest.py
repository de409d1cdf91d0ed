"""Process-wide test set-up, for every test directory."""

from __future__ import annotations

import importlib.util

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


# --- parallel run (issue 24): scripts/test.sh runs pytest-xdist with --dist loadgroup --no-loadscope-reorder.
# The unit of scheduling is a group, run whole, in file order, by one worker: a module by default (its
# module fixtures are set up once), or the `xdist_group` a module names, for suites that share a lab
# world (tests/lab: one deploy serves every module of the group). Each worker has a lab of its own
# (tests/lab/conftest.py), so groups on different workers never share hosts.
# Groups start longest first (docs/ci-time.md has the figures): a long group started last would
# leave the other worker idle at the end. Every other group follows in collection order.
LONGEST_FIRST = (
    "lab-engine",  # tests/lab: canary, deploy rollout, fleet, plan on ct129/ct130
    "lab-real-sglang",  # tests/lab/test_real_sglang_lab.py on ct131
    "tests/sglang/test_real_server.py",
)


def _group(item: pytest.Item) -> str:
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return mark.args[0] if mark.args else mark.kwargs.get("name", "default")
    return item.nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks (it runs in every worker)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_group(item)))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_group(item), len(rank)))  # stable: file order kept within
