"""Every role default is declared in meta/argument_specs.yml (same key set, same default), per entry point."""

from __future__ import annotations

import pytest
import yaml

from tests.unit._ansible import REPO

ROLES = ("ddtree_runtime", "sglang_service", "ddtree_probe", "sglang_router", "sglang_rotation")
# The one rollout sequence with its rescue: a single entry point, no preflight of its own.
ALL_ROLES = (*ROLES, "sglang_rollout")


def load(role: str, path: str) -> dict:
    return yaml.safe_load((REPO / "roles" / role / path).read_text()) or {}


@pytest.mark.parametrize("role", ALL_ROLES)
def test_role_layout(role):
    for part in ("defaults/main.yml", "tasks/main.yml", "meta/main.yml", "meta/argument_specs.yml"):
        assert (REPO / "roles" / role / part).is_file(), f"{role}/{part}"


@pytest.mark.parametrize("role", sorted(p.name for p in (REPO / "roles").iterdir() if p.is_dir()))
def test_a_handlers_file_holds_handlers(role):
    """A role that restarts nothing through a handler has no handlers/ (ansible-lint asks for none)."""
    path = REPO / "roles" / role / "handlers" / "main.yml"
    assert not path.exists() or load(role, "handlers/main.yml"), f"{role}/handlers/main.yml: empty, remove it"


@pytest.mark.parametrize("role", ALL_ROLES)
def test_argspec_covers_every_default(role):
    defaults = load(role, "defaults/main.yml")
    specs = load(role, "meta/argument_specs.yml")["argument_specs"]
    assert set(specs) >= ({"main", "preflight"} if role in ROLES else {"main"})
    for entry, spec in specs.items():
        options = spec["options"]
        assert set(options) == set(defaults), (
            f"{role} entry point {entry}: only in defaults {sorted(set(defaults) - set(options))}, "
            f"only in argument_specs {sorted(set(options) - set(defaults))}"
        )
        for name, option in options.items():
            assert option.get("description"), f"{role}.{name} has no description"
            assert option.get("type"), f"{role}.{name} has no type"
            assert option.get("default") == defaults[name], f"{role}.{name}: argspec default differs"
            if "choices" in option and "{{" not in str(defaults[name]):
                # a list's choices hold for each element
                chosen = defaults[name] if option["type"] == "list" else [defaults[name]]
                assert set(chosen) <= set(option["choices"]), f"{role}.{name}: default not among choices"


def test_profile_choices_match_the_profiles_file():
    profiles = load("sglang_service", "vars/profiles.yml")["sglang_service_profiles"]
    spec = load("sglang_service", "meta/argument_specs.yml")["argument_specs"]["main"]["options"]
    assert spec["sglang_service_profile"]["choices"] == list(profiles)


@pytest.mark.parametrize("role", ALL_ROLES)
def test_role_variables_carry_the_role_prefix(role):
    for name in load(role, "defaults/main.yml"):
        assert name.startswith(role + "_"), name


def _includes(node) -> list[tuple[str, str]]:
    """(role, entry point) of every include_role / import_role below ``node``."""
    found = []
    if isinstance(node, dict):
        for key in ("ansible.builtin.include_role", "ansible.builtin.import_role"):
            if isinstance(node.get(key), dict):
                found.append((node[key]["name"], node[key].get("tasks_from", "main")))
        node = list(node.values())
    if isinstance(node, list):
        for value in node:
            found += _includes(value)
    return found


def _callers() -> list:
    """The plays and the roles (a test playbook may run a role's inner task file alone)."""
    plays = [*REPO.glob("*.yml"), *(REPO / "ansible").glob("*.yml")]
    return sorted({*plays, *(REPO / "roles").rglob("tasks/*.yml")})


def test_every_entry_point_called_has_its_argument_spec():
    called = {(role, entry, path.relative_to(REPO)) for path in _callers()
              for role, entry in _includes(yaml.safe_load(path.read_text()))}
    assert len({(r, e) for r, e, _ in called}) > 20  # the walk finds the plays' and the roles' includes
    for role, entry, where in sorted(called):
        if "{{" in entry:  # ansible/rotation.yml: -e rotation=join|leave, checked by its play
            continue
        specs = load(role, "meta/argument_specs.yml")["argument_specs"]
        assert entry in specs, f"{where} calls {role} tasks_from {entry}, which has no argument spec"
        assert (REPO / "roles" / role / "tasks" / f"{entry}.yml").is_file(), (role, entry)
