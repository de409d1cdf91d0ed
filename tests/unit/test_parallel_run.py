"""The parallel test run (scripts/test.sh: pytest-xdist, --dist loadgroup): each worker's lab is its own,
a group runs whole and in file order, and the longest groups start first (docs/ci-time.md)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import tests.conftest as top
from ddtree_runtime.ops.labhosts.spec import NAME_MAX, Lab
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
class Item:
    nodeid: str


@dataclass(eq=False)  # hashed by identity, as xdist's scheduler keys its workers
class Worker:
    """What xdist's scheduler drives: a worker that is sent test indexes and told to shut down."""

    name: str
    queue: list[int] = field(default_factory=list)
    ran: list[str] = field(default_factory=list)
    shutting_down: bool = False

    @property
    def gateway(self) -> object:
        return type("Gateway", (), {"id": self.name})()

    def send_runtest_some(self, indexes: list[int]) -> None:
        self.queue += indexes

    def shutdown(self) -> None:
        self.shutting_down = True


class Config:
    """The options scripts/test.sh gives: -n 2 --dist loadgroup --no-loadscope-reorder."""

    option = type("Option", (), {"loadscopereorder": False})()

    def getvalue(self, name: str) -> object:
        return {"dist": "loadgroup", "tx": ["2*popen"]}[name]


COLLECTED = [  # in collection order, as every worker collects them
    "tests/lab/test_canary_lab.py::test_1",
    "tests/lab/test_canary_lab.py::test_2",
    "tests/lab/test_deploy_rollout.py::test_1",
    "tests/lab/test_lab_hosts.py::test_1",
    "tests/lab/test_plan_lab.py::test_1",
    "tests/lab/test_real_sglang_lab.py::test_1",
    "tests/lab/test_real_sglang_lab.py::test_2",
    "tests/sglang/test_real_server.py::test_1",
    "tests/unit/test_a.py::test_1",
    "tests/unit/test_a.py::test_2",
    "tests/unit/test_b.py::test_1",
]


def test_the_longest_groups_start_first_and_each_runs_whole_on_one_worker_in_file_order() -> None:
    pytest.importorskip("xdist")
    items = [Item(nodeid) for nodeid in COLLECTED]
    top.pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    collection = [item.nodeid for item in items]
    assert collection[:5] == [
        "tests/lab/test_canary_lab.py::test_1", "tests/lab/test_canary_lab.py::test_2",
        "tests/lab/test_deploy_rollout.py::test_1", "tests/lab/test_plan_lab.py::test_1",
        "tests/lab/test_real_sglang_lab.py::test_1",
    ]  # fmt: skip

    scheduler = top.pytest_xdist_make_scheduler(Config(), None)  # type: ignore[arg-type]
    workers = [Worker("gw0"), Worker("gw1")]
    for worker in workers:
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, collection)
    scheduler.schedule()
    while any(w.queue for w in workers):  # gw1 runs its tests twice as fast, test by test
        for worker in [workers[1], workers[1], workers[0]]:
            if worker.queue:
                index = worker.queue.pop(0)
                worker.ran.append(collection[index])
                scheduler.mark_test_complete(worker, index)
    assert sorted(n for w in workers for n in w.ran) == sorted(COLLECTED)  # every test, once
    gw0, gw1 = workers
    # The lab-engine group went whole to the first worker, in file order; the real-SGLang lab to the other.
    assert gw0.ran[:4] == collection[:4]
    assert gw1.ran[:2] == collection[4:6]
    for group in {top.group_of(n) for n in COLLECTED}:
        where = {w.name for w in workers for n in w.ran if top.group_of(n) == group}
        assert len(where) == 1, f"{group} ran on {sorted(where)}"
        ran = [n for w in workers for n in w.ran if top.group_of(n) == group]
        assert ran == [n for n in collection if top.group_of(n) == group], f"{group} ran out of order"


def test_each_grouped_or_early_module_is_one_the_suite_has() -> None:
    """A renamed module would silently lose its group (a second lab world) or its early start."""
    for path in top.SHARED_WORLDS:
        assert (REPO / path).is_file(), f"SHARED_WORLDS names {path}: no such module"
    groups = set(top.SHARED_WORLDS.values())
    for group in top.LONGEST_FIRST:
        assert group in groups or (REPO / group).is_file(), f"LONGEST_FIRST names {group}: no such group"


# --- the fast loop (`make check`: -m "not slow", docs/testing.md)
def test_a_fast_test_that_starts_a_process_fails() -> None:
    assert "tests/unit/test_parallel_run.py" in top.FAST_MODULES  # so the guard is on here
    with pytest.raises(AssertionError, match="starts a process"):
        subprocess.run(["true"], check=False)


def test_every_module_outside_the_fast_list_is_marked_slow() -> None:
    @dataclass
    class Marked:
        nodeid: str
        marks: list[str] = field(default_factory=list)

        def add_marker(self, mark: pytest.MarkDecorator) -> None:
            self.marks.append(mark.name)

    slow, fast = Marked("tests/unit/test_fleet.py::test_x"), Marked("tests/unit/test_tree_build.py::test_y")
    lab = Marked("tests/lab/test_router_lab.py::test_z")
    for item in (slow, fast, lab):
        top.pytest_itemcollected(item)  # type: ignore[arg-type]
    assert (slow.marks, fast.marks, lab.marks) == (["slow"], [], ["slow"])
    assert all((REPO / module).is_file() for module in top.FAST_MODULES)
