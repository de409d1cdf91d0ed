"""The lab hosts install only from the wheelhouse: every package the lab inventory asks for must be
one the wheelhouse is filled with, at the same pinned version."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
_NAME = re.compile(r"^([A-Za-z0-9_.\-]+)\s*(?:==\s*([^\s;#]+))?")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheelhouse_requirements(path: Path) -> dict[str, str | None]:
    """name -> pinned version (None when unpinned), following `-r` includes."""
    found: dict[str, str | None] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-r "):
            found.update(wheelhouse_requirements(path.parent / line[3:].strip()))
            continue
        match = _NAME.match(line)
        assert match, f"{path.name}: cannot read {raw!r}"
        found[_canonical(match.group(1))] = match.group(2)
    return found


def test_lab_inventory_asks_only_for_what_the_wheelhouse_holds():
    wheelhouse = wheelhouse_requirements(ROOT / "requirements" / "lab-wheelhouse.txt")
    lab_vars = yaml.safe_load((ROOT / "inventories" / "lab" / "group_vars" / "all.yml").read_text())
    asked = lab_vars["ddtree_runtime_packages"] + lab_vars["ddtree_runtime_nodeps_packages"]
    assert asked, "the lab inventory installs nothing?"
    for requirement in asked:
        match = _NAME.match(requirement)
        name, version = _canonical(match.group(1)), match.group(2)
        assert name in wheelhouse, f"{requirement}: not in requirements/lab-wheelhouse.txt (or its includes)"
        if version is not None and wheelhouse[name] is not None:
            assert version == wheelhouse[name], (
                f"lab inventory pins {requirement} but the wheelhouse holds {name}=={wheelhouse[name]}"
            )
