"""Each role variable is stated once: its name, type and choices in the role's meta/argument_specs.yml
(defaults/main.yml holds the default, ansible-core does not apply argument-spec defaults; the argspec tests
keep the two equal). The inputs dicts, the templates and the Python input rules may only name what the
specs declare (or what the role derives itself), and the rules read types and choices from the specs."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddtree_runtime.inputs import argspec, role_checks, router_flags
from tests.unit._ansible import REPO

ROLES = sorted(p.name for p in (REPO / "roles").iterdir() if (p / "meta" / "argument_specs.yml").is_file())
# Each role's content rules (ranges, shapes) and the inputs it derives rather than takes.
CONTENT = {
    "sglang_service": (role_checks.SERVICE, role_checks.SERVICE_DERIVED),
    "sglang_canary": (role_checks.CANARY, ()),
    "ddtree_exporter": (role_checks.EXPORTER, ()),
    "ddtree_probe": (role_checks.PROBE, ()),
    "ddtree_runtime": (role_checks.RUNTIME, ()),
    "sglang_rotation": (role_checks.ROTATION, ()),
    "sglang_router": (router_flags.ROUTER, router_flags.ROUTER_DERIVED),
}


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def _inputs(role: str) -> dict[str, str]:
    return (_yaml(REPO / "roles" / role / "vars" / "main.yml") or {}).get(f"{role}_inputs", {})


def _walk(node: Any) -> Iterator[Any]:
    yield node
    if isinstance(node, dict):
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def _internal(role: str) -> set[str]:
    """What a role defines for itself: vars/, set_fact, register, task vars, loop variables."""
    names = set(_yaml(REPO / "roles" / role / "vars" / "main.yml") or {})
    for path in (REPO / "roles" / role).rglob("*.yml"):
        for node in _walk(_yaml(path)):
            if not isinstance(node, dict):
                continue
            for key in ("ansible.builtin.set_fact", "set_fact", "vars"):
                if isinstance(node.get(key), dict):
                    names |= set(node[key])
            if isinstance(node.get("register"), str):
                names.add(node["register"])
            if isinstance(node.get("loop_control"), dict) and "loop_var" in node["loop_control"]:
                names.add(node["loop_control"]["loop_var"])
    return names


def _owner(name: str) -> str | None:
    return max((r for r in ROLES if name.startswith(r + "_")), key=len, default=None)


def test_every_role_with_inputs_has_its_rules():
    assert {r for r in ROLES if _inputs(r)} == set(CONTENT)


@pytest.mark.parametrize("role", sorted(CONTENT))
def test_the_inputs_dict_carries_spec_options_under_their_own_names(role):
    options = argspec.options(role)
    derived = CONTENT[role][1]
    for key, expression in _inputs(role).items():
        if key in derived:
            assert f"{role}_{key}" not in options, f"{role}_inputs.{key} is an option: not derived"
            continue
        assert f"{role}_{key}" in options, f"{role}_inputs.{key}: {role}_{key} is not in its argument spec"
        assert re.fullmatch(r"\{\{ *" + f"{role}_{key}" + r" *\}\}", str(expression)), (role, key, expression)
    assert set(derived) <= set(_inputs(role)), derived


@pytest.mark.parametrize("role", sorted(CONTENT))
def test_content_rules_add_only_what_a_spec_cannot_say(role):
    options = argspec.options(role)
    content, _ = CONTENT[role]
    for name, rule in content.items():
        assert name in options, f"a rule for {name}: roles/{role}/meta/argument_specs.yml does not declare it"
        option = options[name]
        # The spec's type and choices are checked from the spec: a rule there would never run.
        assert option["type"] != "bool" and "choices" not in option, f"{name}: its spec says it all"
        if isinstance(rule, argspec.Range):
            assert option["type"] in ("int", "float"), f"{name}: a range on a {option['type']}"
    carried = {f"{role}_{k}" for k in _inputs(role)}
    for name, option in options.items():
        if name in carried and option["type"] in ("int", "float"):
            assert name in content, f"{name}: a number the role takes needs its range in the content rules"


def test_option_checks_follow_the_spec():
    """Types and choices as the spec gives them, whatever the rules say."""
    role = "sglang_router"
    spec = argspec.options(role)
    assert spec["sglang_router_policy"]["choices"] == ["cache_aware", "round_robin", "random", "power_of_two"]
    bad = {"policy": "fastest", "install_source": "ftp", "workers": "ct129"}
    said = argspec.option_problems(role, bad, {})
    assert sorted(said) == [
        "sglang_router_install_source: 'ftp' is not index or wheelhouse",
        "sglang_router_policy: 'fastest' is not cache_aware, round_robin, random or power_of_two",
        "sglang_router_workers: 'ct129' is not a list (of at most 256 strings)",
    ]
    assert argspec.option_problems(role, {"wheelhouse": "srv/w"}, {}) == [
        "sglang_router_wheelhouse: 'srv/w' is not an absolute path (it must start with '/')"]
    with pytest.raises(KeyError, match="sglang_router_nonesuch"):
        argspec.option_problems(role, {}, {"sglang_router_nonesuch": argspec.Range(0, 1)})
    with pytest.raises(KeyError, match="without a Range"):
        argspec.option_problems(role, {"port": 1}, {})


def _templates() -> list[Path]:
    return sorted([*(REPO / "templates").glob("*.j2"), *(REPO / "roles").glob("*/templates/*.j2")])


def _undeclared(text: str) -> set[str]:
    """Role-prefixed names in a template that neither the role's spec nor the role itself defines."""
    text = re.sub(r"\|\s*[a-z_]+", "|", text)  # filters (ddtree_*) are not variables
    return {name for name in set(re.findall(r"\b[a-z][a-z0-9_]*\b", text))
            if (role := _owner(name)) and name not in argspec.options(role) and name not in _internal(role)}


@pytest.mark.parametrize("template", _templates(), ids=lambda p: str(p.relative_to(REPO)))
def test_templates_name_only_spec_options_or_what_the_role_derives(template):
    unknown = _undeclared(template.read_text())
    assert not unknown, f"{template.name} names role variables no argument spec declares: {sorted(unknown)}"


def test_the_template_check_sees_an_undeclared_variable():
    assert _undeclared("TimeoutStopSec={{ sglang_service_stop_timeout }}") == set()
    assert _undeclared("{{ sglang_service_argv_words | ddtree_exec_line }}") == {"sglang_service_argv_words"}
    assert _undeclared("{{ sglang_service_stop_timeout_s }}") == {"sglang_service_stop_timeout_s"}
    assert _undeclared("{{ sglang_service_inputs | ddtree_service_argv }}") == set()  # vars/main.yml
