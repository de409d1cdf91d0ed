"""The package's import graph, as docs/architecture.md draws it ("The floors"): no two modules import each
other (the last circles were untangled in December 2026), the host side never imports the controller side,
and each floor imports only the floors below it (core at the bottom; health and the input rules on core; the
engines on core). The page's table and FLOORS below are checked against each other.

Read statically (every `import` statement, also those inside functions: a lazy import is still a
dependency), so the test sees circles that only bite at run time.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

import pytest

PACKAGE = "ddtree_runtime"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

# Controller-side code: runs where ansible-playbook runs (paramiko, nspawn), never on a GPU host.
CONTROLLER = (f"{PACKAGE}.ops",)
# The CLI composes both sides by module name (importlib), so it is neither.
COMPOSERS = (f"{PACKAGE}.cli", f"{PACKAGE}.__main__")

# Each floor (a folder) and the floors of ours it may import; the package root (its version) is open to all.
FLOORS: dict[str, tuple[str, ...]] = {
    f"{PACKAGE}.core": (),
    f"{PACKAGE}.health": (f"{PACKAGE}.core",),
    f"{PACKAGE}.inputs": (f"{PACKAGE}.core",),
    f"{PACKAGE}.tiny_engine": (f"{PACKAGE}.core",),
    f"{PACKAGE}.sglang_plugin": (f"{PACKAGE}.core",),
    f"{PACKAGE}.planner": (f"{PACKAGE}.core", f"{PACKAGE}.inputs"),
}

# Modules a role sends alone to a host and runs there with the host's python (Ansible's script module):
# no package on sys.path there, so they import the standard library only (one package import breaks
# every deploy's fit check). roles/sglang_service/tasks/fit.yml ships core/model_files.py, tasks/wait.yml
# health/readiness.py (the one readiness poller, which the probe and the canary import).
SHIPPED_ALONE = (f"{PACKAGE}.core.model_files", f"{PACKAGE}.health.readiness")
ROLES = ROOT.parent / "roles"

# Circles still to untangle (docs/architecture.md: untangled when someone works in its rooms). Shrink only.
KNOWN_CIRCLES: set[frozenset[str]] = set()
# Host-side modules that still reach into the controller side (each one a circle above too).
KNOWN_HOST_TO_CONTROLLER: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (a name imported from a package counts as the
    submodule when one of that name exists, else as the package)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, path.name == "__init__.py", node)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]  # fmt: skip
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target.startswith(PACKAGE) and target != name:
                    graph[name].add(target)
    return graph


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative enough for a package of this size."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            out.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _is_controller(module: str) -> bool:
    return any(module == c or module.startswith(c + ".") for c in CONTROLLER)


def test_graph_sees_lazy_and_relative_imports() -> None:
    graph = import_graph()
    # tree dispatches to the kernels inside functions; kernels/__init__ imports .build lazily.
    assert f"{PACKAGE}.core.kernels" in graph[f"{PACKAGE}.core.tree"]
    assert f"{PACKAGE}.core.kernels.build" in graph[f"{PACKAGE}.core.kernels"]


def _floor(module: str) -> str | None:
    return next((f for f in FLOORS if module == f or module.startswith(f + ".")), None)


@pytest.mark.parametrize("module", sorted(_modules()))
def test_each_floor_imports_only_the_floors_below(module: str) -> None:
    floor = _floor(module)
    if floor is None:
        return
    allowed = (floor, *FLOORS[floor])
    bad = {t for t in import_graph()[module]
           if t != PACKAGE and not any(t == a or t.startswith(a + ".") for a in allowed)}  # fmt: skip
    assert not bad, f"{module} ({floor}) may import only {sorted(allowed)}, imports {sorted(bad)}"


ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"


def _documented_floors() -> dict[str, set[str] | None]:
    """docs/architecture.md's floors table: folder -> the floors it may import (None: any floor)."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("## The floors") :]
    section = section[: section.index("\n## ", 1)]
    floors: dict[str, set[str] | None] = {}
    for row in re.findall(r"^\| `(\w+)/` \|.*\| ([^|]+) \|$", section, re.M):
        folder, may = row
        floors[f"{PACKAGE}.{folder}"] = None if "any floor" in may else {
            f"{PACKAGE}.{name}" for name in re.findall(r"`(\w+)`", may)}  # fmt: skip
    return floors


def test_the_architecture_page_draws_these_floors() -> None:
    documented = _documented_floors()
    assert documented, f"{ARCHITECTURE} has no floors table"
    drawn = {floor: allowed for floor, allowed in documented.items() if allowed is not None}
    assert drawn == {floor: set(allowed) for floor, allowed in FLOORS.items()}, (
        "docs/architecture.md's floors and FLOORS here differ: change both")
    assert {floor for floor, allowed in documented.items() if allowed is None} == set(CONTROLLER)


def test_floor_rule_sees_a_reach_upwards() -> None:
    """The rule above is not vacuous: core's tree reaches the kernels, health's static probe the contract."""
    graph = import_graph()
    assert _floor(f"{PACKAGE}.core.tree") == f"{PACKAGE}.core"
    assert f"{PACKAGE}.core.contract" in graph[f"{PACKAGE}.health.probe_static"]
    assert _floor(f"{PACKAGE}.ops.fleet") is None  # the controller side may import any floor


def test_no_import_circles() -> None:
    circles = sorted(sorted(c) for c in _strongly_connected(import_graph()) if len(c) > 1)
    assert not circles, f"modules that import each other (split out what they share): {circles}"


@pytest.mark.parametrize("module", sorted(_modules()))
def test_host_side_never_imports_controller_side(module: str) -> None:
    if _is_controller(module) or module in COMPOSERS:
        return
    bad = {t for t in import_graph()[module] if _is_controller(t)}
    assert not bad, f"host-side {module} imports controller-side {sorted(bad)}"


def _shipped_by_roles() -> set[str]:
    """The package modules the roles' ``ansible.builtin.script`` tasks run from the checkout."""
    found: set[str] = set()
    for path in sorted(ROLES.rglob("*.yml")):
        for rel in re.findall(r"ddtree_checkout_dir \}\}/(ddtree_runtime/[\w/]+)\.py", path.read_text()):
            found.add(rel.replace("/", "."))
    return found


def test_roles_ship_alone_only_the_modules_that_can_run_alone() -> None:
    shipped = _shipped_by_roles()
    assert shipped, "no role ships a module of ours any more: update SHIPPED_ALONE"
    assert shipped <= set(SHIPPED_ALONE), f"roles ship {sorted(shipped - set(SHIPPED_ALONE))}: not standalone"
    assert set(SHIPPED_ALONE) <= set(_modules()), "a SHIPPED_ALONE module no longer exists"


@pytest.mark.parametrize("module", SHIPPED_ALONE)
def test_modules_shipped_alone_import_the_standard_library_only(module: str) -> None:
    path = _modules()[module]
    bad: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = ["." * node.level + (node.module or "")]  # a relative import needs the package
        else:
            continue
        bad += [n for n in names if n.startswith(".") or n.split(".")[0] not in sys.stdlib_module_names]
    assert not bad, f"{module} runs alone on hosts (stdlib python, no package): it may not import {bad}"
