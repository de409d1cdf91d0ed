"""The two lab layers share one base (``ddtree_sglang_lab_base``): these fail when they drift apart
again (issue 32: each had grown its own copy of the seam, boot, fault and stand-in machinery, and the
real-server process harness was written twice).

Read from the source tree (what the next wheel is built from), plus what the installed layers bind.
Starts no process."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "scripts/lab/sglang-lab-base/ddtree_sglang_lab_base"
LAYERS = {
    "ddtree_sglang_cpu_lab": ROOT / "scripts/lab/sglang-cpu-lab/ddtree_sglang_cpu_lab",
    "ddtree_sglang_gpu_lab": ROOT / "scripts/lab/sglang-gpu-lab/ddtree_sglang_gpu_lab",
}
# Who starts the real SGLang server: through the base's harness only.
HARNESS_USERS = (ROOT / "tests/sglang/_real_server.py", LAYERS["ddtree_sglang_gpu_lab"] / "server.py",
                 ROOT / "tests/unit/_tiny_server.py")
# The base's machinery: defined there, never again in a layer.
SHARED = {
    "Seam", "SeamMoved", "Seams", "Refused", "UnknownFault", "MissingOp", "StandinModule", "StandinPackage",
    "StandinFinder", "ServerProcess", "ServerFailed", "after_import", "object_digest", "file_digest",
    "seam_named", "moved_message", "require", "moved", "check_version", "resolve", "boot",
    "install_layer", "render_flags", "profile_flags",
}  # fmt: skip
# Each layer's seams module names its digest reader after the base's (an alias, never a def of its own).
ALIASES = {"source_digest"}
HARNESS_METHODS = {"wait_ready", "wait_exit", "stop", "request", "generate", "metrics"}
# A one-module stand-in with fixed attributes (not a kernel package): its own finder, inserted first.
OWN_FINDER_OK = {"ddtree_sglang_gpu_lab/cutedsl_standin.py"}


def _layer_modules() -> list[Path]:
    return sorted(p for d in LAYERS.values() for p in d.glob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _rel(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


def test_the_base_is_a_distribution_of_its_own():
    """Its own project beside the layers (issue 42: it lived inside the CPU layer's package), built into
    no layer's wheel."""
    import tomllib

    def packages(project: Path) -> list[str]:
        return tomllib.loads((project / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]

    assert packages(BASE.parent) == [BASE.name]
    for layer in LAYERS.values():
        assert not any(p == BASE.name or p.endswith(".base") for p in packages(layer.parent)), layer.parent
        assert not (layer / "base").exists(), f"{_rel(layer)}/base: the base lives in {BASE.parent.name}/"


def test_the_base_is_where_the_shared_machinery_is_defined():
    defined = {n.name for p in BASE.glob("*.py") for n in ast.walk(_tree(p))
               if isinstance(n, ast.FunctionDef | ast.ClassDef)}  # top level and methods (Seams.require)
    assert SHARED - defined == set()


@pytest.mark.parametrize("path", [*_layer_modules(), *HARNESS_USERS], ids=_rel)
def test_no_layer_module_defines_its_own_copy_of_the_base(path):
    tree = _tree(path)
    copies = [n.name for n in tree.body
              if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name in SHARED | ALIASES]  # fmt: skip
    assert copies == [], f"{_rel(path)} defines {copies}: use ddtree_sglang_lab_base's"
    methods = [f"{c.name}.{f.name}" for c in tree.body if isinstance(c, ast.ClassDef) for f in c.body
               if isinstance(f, ast.FunctionDef) and f.name in HARNESS_METHODS]  # fmt: skip
    assert methods == [], f"{_rel(path)} defines {methods}: the server harness is base.server's"
    if _rel(path) not in OWN_FINDER_OK:
        text = path.read_text()
        assert "sys.meta_path" not in text, f"{_rel(path)}: import hooks go through base.hooks/base.standin"
    assert "lease_ports" not in path.read_text(), f"{_rel(path)}: ports are leased by base.server"


def _hooked_modules_of_ours() -> list[tuple[str, str]]:
    """(layer module, target) for each ``after_import("ddtree_runtime...", ...)`` and each module-level
    string naming a module of ours that a layer hooks by name."""
    found = []
    for path in _layer_modules():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value.startswith("ddtree_runtime.") and " " not in node.value:
                found.append((_rel(path), node.value))
    return found


def test_every_module_of_ours_a_layer_hooks_exists():
    """A layer patches the plugin by module name when it is imported: a renamed module would leave the
    patch silently unapplied (the CPU layer's torch_native tree verify, its verify faults)."""
    hooked = _hooked_modules_of_ours()
    assert any(target.endswith(".refusals.resolution") for _, target in hooked)  # the rule sees them
    missing = [(where, target) for where, target in hooked
               if not (ROOT / (target.replace(".", "/") + ".py")).is_file()
               and not (ROOT / target.replace(".", "/") / "__init__.py").is_file()]  # fmt: skip
    assert missing == [], f"layers hook modules that do not exist: {missing}"


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_each_layer_boots_and_installs_through_the_base(package):
    boot = _tree(LAYERS[package] / "boot.py")
    calls = [n.value.func.id for n in boot.body if isinstance(n, ast.Expr)
             and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name)]  # fmt: skip
    assert calls == ["boot"], f"{package}/boot.py: its .pth runs base.layer.boot, nothing else"
    install = (LAYERS[package] / "install.py").read_text()
    assert f'install_layer("{package}", PIECES)' in install
    # Every module of the layer with an install() is a piece the base's sequence installs.
    pieces = {p.stem for p in LAYERS[package].glob("*.py")
              if any(isinstance(n, ast.FunctionDef) and n.name == "install" for n in _tree(p).body)
              or "\ninstall = " in p.read_text()}  # fmt: skip
    module = importlib.import_module(f"{package}.install")
    assert pieces == set(module.PIECES), f"{package}: pieces with an install() but not in PIECES, or gone"


@pytest.mark.parametrize(("package", "read"), [("ddtree_sglang_cpu_lab", "object"),
                                               ("ddtree_sglang_gpu_lab", "file")])  # fmt: skip
def test_each_installed_layer_binds_the_bases_mechanism(package, read):
    pytest.importorskip(package)
    import ddtree_sglang_lab_base as base
    from ddtree_sglang_lab_base import layer, seams, standin

    mod = lambda name: importlib.import_module(f"{package}.{name}")  # noqa: E731
    registry = mod("seams").require.__self__
    assert isinstance(registry, seams.Seams) and registry.read == read and registry.package == package
    assert mod("seams").SeamMoved is seams.SeamMoved and mod("seams").Seam is seams.Seam
    assert mod("faults").UnknownFault is layer.UnknownFault and mod("install").Refused is layer.Refused
    kernel = mod("sgl_kernel_standin")
    assert isinstance(kernel.STANDIN, standin.StandinPackage) and kernel.MissingOp is standin.MissingOp
    assert kernel.STANDIN.require == mod("seams").require  # its callers are checked against its own seams
    assert importlib.import_module(package).PINNED_SGLANG_VERSION == base.PINNED_SGLANG_VERSION


def test_every_server_harness_is_the_bases():
    pytest.importorskip("ddtree_sglang_gpu_lab")
    pytest.importorskip("yaml")
    from ddtree_sglang_gpu_lab.server import GpuServer
    from ddtree_sglang_lab_base.server import ServerProcess

    from tests.sglang._real_server import RealServer
    from tests.unit._tiny_server import TinyServerProcess

    assert all(issubclass(c, ServerProcess) for c in (GpuServer, RealServer, TinyServerProcess))
