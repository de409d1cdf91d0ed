"""The roles run our code on the controller one way (issue 42): the playbook's own interpreter with
``-m ddtree_runtime...`` in ``ddtree_controller_env`` (ansible/vars_plugins/ddtree_checkout.py: the
checkout first on the path), never a script a role carries itself. Read from the role files; starts no
process."""

from __future__ import annotations

import re
from pathlib import Path

from tests.unit._ansible import REPO

ROLES = REPO / "roles"
# After `ansible_playbook_python`, in YAML or Jinja spelling: `-m` and a module of ours.
OURS = re.compile(r"""\s*(?:\}\}["']?)?\s*,\s*['"]?-m['"]?\s*,\s*['"]?(ddtree_runtime[\w.]*)""")
ENVIRONMENT = 'environment: "{{ ddtree_controller_env }}"'


def _calls() -> list[tuple[str, str | None]]:
    """(task file, the module it runs or None) for every argv the controller's interpreter heads."""
    found = []
    for path in sorted(ROLES.rglob("*.yml")):
        text = path.read_text()
        for at in re.finditer("ansible_playbook_python", text):
            ours = OURS.match(text, at.end())
            found.append((str(path.relative_to(REPO)), ours.group(1) if ours else None))
    return found


def test_each_controller_call_runs_a_module_of_ours():
    calls = _calls()
    assert len(calls) >= 4, calls  # the rule sees them: plan, rotation, canary traffic, the release build
    bad = [file for file, module in calls if module is None]
    assert bad == [], f"controller tasks that run something other than `-m ddtree_runtime...`: {bad}"


def test_each_controller_call_has_the_controller_environment():
    files = sorted({file for file, _ in _calls()})
    bare = [f for f in files if ENVIRONMENT not in (REPO / f).read_text()]
    assert bare == [], f"task files that run our code on the controller without {ENVIRONMENT}: {bare}"


def test_no_role_carries_the_release_build_itself():
    assert not list(Path(ROLES).glob("*/files/build_release.py"))
    assert (REPO / "ddtree_runtime/ops/build_release.py").is_file()
