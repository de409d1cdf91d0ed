"""The SGLang plugin's map (its ``__init__`` docstring) names every module the package holds, so a
reader who opens the package finds each module's job in one place (issue 32)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PLUGIN = Path(__file__).resolve().parents[2] / "ddtree_runtime" / "sglang_plugin"


def _map_names() -> set[str]:
    """The lower-case names quoted in the map (the docstring from "The modules"), SGLang's own
    modules (``dflash_*``), which the map quotes for comparison, left out."""
    doc = ast.get_docstring(ast.parse((PLUGIN / "__init__.py").read_text())) or ""
    section = doc[doc.index("The modules") :]
    return {n for n in re.findall(r"``([a-z_]+)``", section) if not n.startswith("dflash_")}


def _modules() -> set[str]:
    """The plugin's modules and subpackages, and the modules inside its subpackages."""
    found = {p.stem for p in PLUGIN.glob("*.py") if p.stem != "__init__"}
    for sub in PLUGIN.iterdir():
        if (sub / "__init__.py").is_file():
            found.add(sub.name)
            found |= {p.stem for p in sub.glob("*.py") if p.stem != "__init__"}
    return found


def test_the_map_names_every_module_of_the_plugin():
    modules = _modules()
    missing = sorted(modules - _map_names())
    assert not missing, f"sglang_plugin/__init__.py's map does not name: {missing}; add a line saying its job"


def test_the_map_names_no_module_that_is_gone():
    modules = _modules()
    gone = sorted(_map_names() - modules)
    assert not gone, f"the map names modules that no longer exist: {gone}"
