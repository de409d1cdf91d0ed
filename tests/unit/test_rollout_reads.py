"""The rollout takes data (issue 42): roles/sglang_rollout reads its own options, what it defines itself, and
the one result each role it calls publishes, declared in that role's argument spec ("Publishes one fact,
NAME: {keys}"), never a fact another role sets without declaring it. It passes a role only options that
role's spec declares, and the plays pass it only its own. Read statically: every Jinja expression in its
task, vars and defaults files, parsed."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml
from jinja2 import meta, nodes

from tests.unit._ansible import REPO

ROLLOUT = REPO / "roles" / "sglang_rollout"
ROLE = "sglang_rollout"
PLAYS = ("deploy.yml", "ansible/canary.yml", "ansible/rollback.yml")
# Ansible's own names (magic variables, the templar's functions) and the one inventory variable the
# operator sets for a host's profile (README, "Everyday use"), read by the profile's default.
ANSIBLE = frozenset({
    "inventory_hostname", "ansible_check_mode", "ansible_failed_result", "ansible_failed_task", "groups",
    "hostvars", "item", "now", "omit", "ansible_play_batch", "ansible_playbook_python",
})  # fmt: skip
INVENTORY = frozenset({"sglang_profile"})
CONDITIONS = ("when", "failed_when", "changed_when", "until", "that")
INCLUDES = ("ansible.builtin.include_role", "ansible.builtin.import_role")
_PUBLISHES = re.compile(r"Publishes one fact, (\w+)(?::\s*\{([^}]*)\})?")


class _Any(dict):
    """Ansible's filters and tests, by any name: reading the names needs only to know they are filters."""

    def __contains__(self, name: object) -> bool:
        return True

    def get(self, name: object, default: object = None) -> object:
        return super().get(name, str)


_ENV = jinja2.Environment()
_ENV.filters, _ENV.tests = _Any(), _Any()


@functools.cache
def _yaml(path: Path) -> Any:
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _spec(role: str) -> dict[str, Any]:
    return _yaml(REPO / "roles" / role / "meta" / "argument_specs.yml")["argument_specs"]


@functools.cache
def declared_results() -> dict[str, frozenset[str] | None]:
    """Each role's published fact and its keys (None: not a dict), from its spec's main description."""
    out: dict[str, frozenset[str] | None] = {}
    for path in sorted((REPO / "roles").glob("*/meta/argument_specs.yml")):
        description = _spec(path.parts[-3])["main"].get("description", [])
        text = " ".join(description if isinstance(description, list) else [description])
        found = _PUBLISHES.findall(text)
        assert len(found) <= 1, f"{path}: a role publishes one fact, not {len(found)}"
        for name, keys in found:
            out[name] = frozenset(k.strip() for k in keys.split(",")) if keys else None
    return out


def _files() -> list[Path]:
    return sorted(p for sub in ("tasks", "vars", "defaults") for p in (ROLLOUT / sub).glob("*.yml"))


def _expressions(node: Any, key: str | None = None) -> Iterator[str]:
    """Every template and bare condition below ``node``, as Jinja source."""
    if isinstance(node, dict):
        for k, value in node.items():
            yield from _expressions(value, k)
    elif isinstance(node, list):
        for value in node:
            yield from _expressions(value, key)
    elif isinstance(node, str):
        if key in CONDITIONS:
            yield "{{ " + node + " }}"
        elif "{{" in node or "{%" in node:
            yield node


def _tasks(node: Any) -> Iterator[dict]:
    if isinstance(node, list):
        for task in node:
            yield from _tasks(task)
    elif isinstance(node, dict):
        yield node
        for key in ("tasks", "block", "rescue", "always"):
            yield from _tasks(node.get(key))


@functools.cache
def _defined() -> frozenset[str]:
    """What the rollout defines itself: its options, vars/, set_fact, register and its own task vars."""
    names = set(_spec(ROLE)["main"]["options"]) | set(_yaml(ROLLOUT / "vars/main.yml"))
    for path in (ROLLOUT / "tasks").glob("*.yml"):
        for task in _tasks(_yaml(path)):
            names |= set(task.get("ansible.builtin.set_fact") or {})
            names |= {task["register"]} if "register" in task else set()
            names |= {k for k in task.get("vars") or {} if k.startswith(ROLE + "_")}
    return frozenset(names)


def _key_reads(tree: nodes.Template) -> Iterator[tuple[str, str]]:
    """(name, key) for ``name.key``, ``name['key']`` and ``(name | default(...)).key``."""
    for node in tree.find_all((nodes.Getattr, nodes.Getitem)):
        target = node.node
        if isinstance(target, nodes.Filter) and target.name == "default":
            target = target.node
        if not isinstance(target, nodes.Name):
            continue
        if isinstance(node, nodes.Getattr):
            yield target.name, node.attr
        elif isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str):
            yield target.name, node.arg.value


def undeclared_reads(sources: list[str]) -> list[str]:
    """What the given Jinja sources read that neither the rollout nor a role's declared result is."""
    results, defined = declared_results(), _defined()
    problems = []
    for source in sources:
        tree = _ENV.parse(source)
        for name in sorted(meta.find_undeclared_variables(tree)):
            if name not in defined | set(results) | ANSIBLE | INVENTORY:
                problems.append(f"{name} (no argument spec declares it)")
        for name, key in _key_reads(tree):
            keys = results.get(name)
            if keys is not None and name not in defined and key not in keys:
                problems.append(f"{name}.{key} (its spec declares {sorted(keys)})")
    return problems


def rollout_sources() -> list[str]:
    return [e for path in _files() for e in _expressions(_yaml(path))]


def test_the_rollout_reads_only_declared_results_and_its_own():
    problems = undeclared_reads(rollout_sources())
    assert not problems, "roles/sglang_rollout reads " + "; ".join(sorted(set(problems)))


def test_the_read_check_is_not_vacuous():
    read = {n for s in rollout_sources() for n in meta.find_undeclared_variables(_ENV.parse(s))}
    results = declared_results()
    # It reads what every role it calls hands back, and finds that in the files.
    for name in ("sglang_service_result", "ddtree_probe_result", "sglang_rotation_result",
                 "sglang_canary_result", "ddtree_runtime_release_dir"):
        assert name in results and name in read, name
    # An undeclared fact, an undeclared key of a result, a bare condition: each is caught.
    assert undeclared_reads(["{{ sglang_service_changing | bool }}"]) == [
        "sglang_service_changing (no argument spec declares it)"]
    assert undeclared_reads(["{{ (sglang_service_result | default({})).changng }}"]) == [
        f"sglang_service_result.changng (its spec declares {sorted(results['sglang_service_result'])})"]
    assert undeclared_reads(list(_expressions({"when": "sglang_rotation_out | bool"}))) == [
        "sglang_rotation_out (no argument spec declares it)"]


def test_each_role_publishes_the_fact_its_spec_declares():
    results = declared_results()
    assert set(results) >= {"sglang_service_result", "ddtree_probe_result", "sglang_rotation_result",
                            "sglang_canary_result", "sglang_rollout_result", "ddtree_runtime_release_dir"}
    for name in results:
        role = next(r.name for r in (REPO / "roles").iterdir() if name.startswith(r.name + "_"))
        files = (REPO / "roles" / role / "tasks").glob("*.yml")
        tasks = [t for p in files for t in _tasks(_yaml(p))]
        set_here = {k for t in tasks for k in t.get("ansible.builtin.set_fact") or {}}
        assert name in set_here, f"roles/{role} declares {name} but never sets it"


def test_the_rollout_sets_only_its_own_facts():
    for path in (ROLLOUT / "tasks").glob("*.yml"):
        for task in _tasks(_yaml(path)):
            for name in task.get("ansible.builtin.set_fact") or {}:
                assert name.startswith(ROLE + "_"), f"{path.name}: {task['name']} sets {name}"


def _passed(path: Path) -> Iterator[tuple[str, str, str]]:
    """(role, entry point, variable) for every variable an include of a role passes it."""
    for task in _tasks(_yaml(path)):
        for key in INCLUDES:
            if isinstance(task.get(key), dict):
                for name in task.get("vars") or {}:
                    yield task[key]["name"], task[key].get("tasks_from", "main"), name


@pytest.mark.parametrize("path", [*(ROLLOUT / "tasks").glob("[!m]*.yml"), *(REPO / p for p in PLAYS)],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_includes_pass_only_declared_options(path):
    passed = list(_passed(path))
    assert passed, f"{path} passes nothing: the walk is broken"
    for role, entry, name in passed:
        assert name in _spec(role)[entry]["options"], f"{path.name} passes {role} ({entry}) undeclared {name}"


def test_the_plays_say_what_they_want():
    """No play names itself: each passes the data its rollout differs by."""
    assert "sglang_rollout_play" not in _spec(ROLE)["main"]["options"]
    wanted = {f"{ROLE}_{k}" for k in ("install", "shadow", "record", "messages")}
    for play in PLAYS:
        passed = {name for role, _, name in _passed(REPO / play) if role == ROLE}
        assert wanted <= passed, f"{play} leaves {sorted(wanted - passed)} to the defaults"
