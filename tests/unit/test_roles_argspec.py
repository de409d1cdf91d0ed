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
    for part in ("defaults/main.yml", "tasks/main.yml", "handlers/main.yml", "meta/main.yml",
                 "meta/argument_specs.yml"):
        assert (REPO / "roles" / role / part).is_file(), f"{role}/{part}"


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
                assert defaults[name] in option["choices"], f"{role}.{name}: default not among choices"


def test_profile_choices_match_the_profiles_file():
    profiles = load("sglang_service", "vars/profiles.yml")["sglang_service_profiles"]
    spec = load("sglang_service", "meta/argument_specs.yml")["argument_specs"]["main"]["options"]
    assert spec["sglang_service_profile"]["choices"] == list(profiles)


@pytest.mark.parametrize("role", ALL_ROLES)
def test_role_variables_carry_the_role_prefix(role):
    for name in load(role, "defaults/main.yml"):
        assert name.startswith(role + "_"), name
