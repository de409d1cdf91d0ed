"""The parallel test run (scripts/test.sh: pytest-xdist, --dist loadgroup): each worker's lab is its own,
a group runs whole and in file order, and the longest groups start first (docs/ci-time.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import tests.conftest as top
from ddtree_runtime.ops.lab_spec import NAME_MAX, Lab
from tests.lab.conftest import lab_name

REPO = Path(__file__).resolve().parents[2]
# The scratch labs tests/lab/test_lab_hosts.py makes next to the session's: (suffix, prefix length).
SCRATCH = (("-dn", 12), ("-co", 12), ("-pw", 12), ("-sa", 10))


@pytest.mark.parametrize("base", ["test", "h24"])
def test_every_worker_gets_a_lab_of_its_own_on_its_own_subnet(monkeypatch, base: str) -> None:
    monkeypatch.setenv("DDTREE_LAB_NAME", base)
    labs = []
    for worker in ("gw0", "gw1", "gw2", "gw3"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        labs.append(Lab(lab_name(), 3))
    assert [lab.name for lab in labs] == [f"{base}-gw{i}" for i in range(4)]
    scratch = {Lab(f"{lab.name[:cut]}{suffix}", 1).k for lab in labs for suffix, cut in SCRATCH}
    subnets = [lab.k for lab in labs]
    # A shared subnet would make the second worker's `lab up` refuse; a scratch lab on a worker's subnet
    # would make test_lab_hosts fail on whichever worker runs it.
    assert len(set(subnets)) == len(subnets) and not scratch & set(subnets)


def test_without_xdist_the_lab_is_the_named_one_and_long_names_still_fit(monkeypatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setenv("DDTREE_LAB_NAME", "h24")
    assert lab_name() == "h24"
    monkeypatch.setenv("DDTREE_LAB_NAME", "a" * NAME_MAX)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw11")
    assert Lab(lab_name(), 3).name == "a" * (NAME_MAX - 5) + "-gw11"


@dataclass
class FakeItem:
    """What the hook reads of a pytest item: the node id and its xdist_group mark."""

    nodeid: str
    group: str | None = None
    marks: list[pytest.Mark] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.group is not None:
            self.marks.append(pytest.mark.xdist_group(self.group).mark)

    def get_closest_marker(self, name: str) -> pytest.Mark | None:
        return next((m for m in self.marks if m.name == name), None)

    def add_marker(self, marker: pytest.MarkDecorator) -> None:
        self.marks.append(marker.mark)


def test_groups_run_whole_in_file_order_and_the_longest_first() -> None:
    items = [
        FakeItem("tests/unit/test_a.py::test_1"),
        FakeItem("tests/unit/test_a.py::test_2"),
        FakeItem("tests/lab/test_canary_lab.py::test_1", "lab-engine"),
        FakeItem("tests/lab/test_canary_lab.py::test_2", "lab-engine"),
        FakeItem("tests/lab/test_lab_hosts.py::test_1"),
        FakeItem("tests/lab/test_real_sglang_lab.py::test_1", "lab-real-sglang"),
        FakeItem("tests/lab/test_deploy_rollout.py::test_1", "lab-engine"),
        FakeItem("tests/sglang/test_real_server.py::test_1"),
    ]
    top.pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    order = [(item.nodeid, item.get_closest_marker("xdist_group").args[0]) for item in items]
    assert order == [
        ("tests/lab/test_canary_lab.py::test_1", "lab-engine"),
        ("tests/lab/test_canary_lab.py::test_2", "lab-engine"),
        ("tests/lab/test_deploy_rollout.py::test_1", "lab-engine"),
        ("tests/lab/test_real_sglang_lab.py::test_1", "lab-real-sglang"),
        ("tests/sglang/test_real_server.py::test_1", "tests/sglang/test_real_server.py"),
        ("tests/unit/test_a.py::test_1", "tests/unit/test_a.py"),
        ("tests/unit/test_a.py::test_2", "tests/unit/test_a.py"),
        ("tests/lab/test_lab_hosts.py::test_1", "tests/lab/test_lab_hosts.py"),
    ]


def test_each_longest_first_group_is_one_the_suite_has() -> None:
    """A renamed module or group would silently lose its early start."""
    declared = {
        m.group(1)
        for path in (REPO / "tests").rglob("test_*.py")
        for m in re.finditer(r'xdist_group\("([^"]+)"\)', path.read_text())
    }
    for group in top.LONGEST_FIRST:
        assert group in declared or (REPO / group).is_file(), f"{group}: no module declares or is it"
