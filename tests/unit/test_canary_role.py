"""The canary role follows the roles' conventions; the canary and rollback playbooks parse."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.unit._ansible import BIN, REPO, tool_env

ROLE = REPO / "roles" / "sglang_canary"
ENTRY_POINTS = {"main", "preflight", "fingerprint", "compare", "remove_shadow", "record", "traffic"}


def _load(path: str) -> dict:
    return yaml.safe_load((ROLE / path).read_text()) or {}


def test_layout_and_an_entry_point_per_task_file():
    for part in ("defaults/main.yml", "tasks/main.yml", "meta/main.yml", "meta/argument_specs.yml",
                 "vars/main.yml"):
        assert (ROLE / part).is_file(), part
    specs = _load("meta/argument_specs.yml")["argument_specs"]
    assert set(specs) == ENTRY_POINTS
    assert {p.stem for p in (ROLE / "tasks").glob("*.yml")} == ENTRY_POINTS


def test_argspec_covers_every_default_with_the_same_default():
    defaults = _load("defaults/main.yml")
    for entry, spec in _load("meta/argument_specs.yml")["argument_specs"].items():
        options = spec["options"]
        assert set(options) == set(defaults), f"{entry}: {set(options) ^ set(defaults)}"
        for name, option in options.items():
            assert option.get("description") and option.get("type"), name
            assert option.get("default") == defaults[name], name
    assert all(name.startswith("sglang_canary_") for name in defaults)


def test_shadow_profiles_exist_in_the_service_profiles():
    profiles = yaml.safe_load((REPO / "roles/sglang_service/vars/profiles.yml").read_text())
    shadow = _load("vars/main.yml")["sglang_canary_shadow_profiles"]
    assert set(shadow) <= set(profiles["sglang_service_profiles"]) and "balanced" not in shadow
    choices = _load("meta/argument_specs.yml")["argument_specs"]["main"]["options"]
    assert choices["sglang_canary_shadow_profile"]["choices"] == shadow
    # Shadows run beside live: on their own port.
    assert all(profiles["sglang_service_profiles"][p]["port"] == _load("defaults/main.yml")[
        "sglang_canary_shadow_port"] for p in shadow)


@pytest.mark.parametrize("playbook", ["ansible/canary.yml", "ansible/rollback.yml"])
@pytest.mark.parametrize("inventory", ["inventories/production", "inventories/lab"])
def test_playbooks_parse(playbook, inventory):
    result = subprocess.run([str(BIN / "ansible-playbook"), "--syntax-check", "-i", inventory, playbook],
                            cwd=REPO, env=tool_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_canary_play_is_host_by_host_and_stops_everything_on_a_failure():
    plays = yaml.safe_load((REPO / "ansible/canary.yml").read_text())
    rollout = plays[1]
    # The canary host alone, then the rest at once; one at a time behind a router (each leaves rotation).
    assert rollout["serial"] == ("{{ canary_serial | default(1 if groups['sglang_routers'] | default([])"
                                 " | length > 0 else [1, '100%']) }}")
    assert rollout["max_fail_percentage"] == 0 and rollout["any_errors_fatal"] is True
    assert all(play["any_errors_fatal"] is True for play in plays)
    # Each host goes through the one rollout and its rescue (roles/sglang_rollout), as a canary.
    (include,) = rollout["tasks"]
    assert include["ansible.builtin.include_role"] == {"name": "sglang_rollout"}
    given = include["vars"]
    assert given["sglang_rollout_shadow"] is True and given["sglang_rollout_record"] == ["canary"]
    rescue = yaml.safe_load((REPO / "roles/sglang_rollout/tasks/rescue.yml").read_text())
    # An abort takes the shadow out of the routers before anything else (after noting what failed).
    first, second = rescue[:2]
    assert "set_fact" in str(first) and second["block"][0]["ansible.builtin.include_role"] == {
        "name": "sglang_rotation", "tasks_from": "remove_shadow"}
