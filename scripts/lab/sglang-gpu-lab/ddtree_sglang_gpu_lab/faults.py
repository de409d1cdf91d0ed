"""Test-only fault switches for the GPU lab (``DDTREE_LAB_FAULT``): not work-arounds. Each
reproduces a known-bad build inside the real server, so the device suite can show it fails on it.

* ``chain_verify_graph``: the plugin before ``graph_sites``: the target-verify graphs are captured
  as DFLASH captures them (no tree mask on Triton, the GDN layers' chain kernels), so every tree
  verify replays a chain's graph. The worker's start check is disarmed with it.
"""

from __future__ import annotations

from types import ModuleType

from ddtree_sglang_lab_base import layer
from ddtree_sglang_lab_base.hooks import after_import
from ddtree_sglang_lab_base.layer import FAULT_ENV, UnknownFault

ENV = FAULT_ENV
FAULTS = ("chain_verify_graph",)

__all__ = ["ENV", "FAULTS", "UnknownFault", "install", "selected_fault"]


def selected_fault() -> str | None:
    return layer.selected_fault(FAULTS, f"not a GPU-lab fault switch; known: {', '.join(FAULTS)}")


def _chain_graphs(module: ModuleType) -> None:
    module.capture_trees = lambda: False


def _no_start_check(module: ModuleType) -> None:
    module.check_tree_graphs = lambda runner: None


def install() -> None:
    if selected_fault() != "chain_verify_graph":
        return
    after_import("ddtree_runtime.sglang_plugin.graph_sites", _chain_graphs)
    after_import("ddtree_runtime.sglang_plugin.ddtree_worker", _no_start_check)
