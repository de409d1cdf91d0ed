"""One rollout (issues 32, 42): deploy, canary and rollback include roles/sglang_rollout with what each wants;
its steps and its rescue are two files in one block; the service restarts in its own sequence, not through a
flushed handler; the roles find the checkout one way and run its code on the controller one way."""

from __future__ import annotations

import pytest
import yaml

from tests.unit._ansible import REPO

# What each play wants of the rollout: install, a shadow stage, what to record.
PLAYS = {
    "deploy.yml": (True, False, ["metrics"]),
    "ansible/canary.yml": (True, True, ["canary"]),
    "ansible/rollback.yml": (False, False, []),
}


def _yaml(path: str):
    return yaml.safe_load((REPO / path).read_text())


def _tasks(tasks: list) -> list:
    """Every task, blocks and rescues opened."""
    out = []
    for task in tasks or []:
        out.append(task)
        for key in ("block", "rescue", "always"):
            out += _tasks(task.get(key))
    return out


@pytest.mark.parametrize(("playbook", "wants"), PLAYS.items())
def test_each_play_includes_the_one_rollout_with_its_own_inputs(playbook, wants):
    rollout = _yaml(playbook)[-1]
    includes = [
        t
        for t in _tasks(rollout["tasks"])
        if t.get("ansible.builtin.include_role", {}).get("name") == "sglang_rollout"
    ]
    assert len(includes) == 1
    given = includes[0]["vars"]
    asked = (given["sglang_rollout_install"], given["sglang_rollout_shadow"], given["sglang_rollout_record"])
    assert asked == wants
    assert all(name.startswith("sglang_rollout_") for name in includes[0]["vars"])
    # No rescue of its own, and no set_fact of role inputs that would outlive the include.
    assert not [t for t in _tasks(rollout["tasks"]) if "rescue" in t]
    assert not [t for t in _tasks(rollout["tasks"]) if "ansible.builtin.set_fact" in t]


def _included(tasks: list) -> list[tuple[str, str]]:
    roles = [t["ansible.builtin.include_role"] for t in _tasks(tasks) if "ansible.builtin.include_role" in t]
    return [(r["name"], r.get("tasks_from", "main")) for r in roles]


def test_the_steps_and_the_rescue_are_two_files_in_one_block_in_order():
    (block,) = _yaml("roles/sglang_rollout/tasks/main.yml")
    assert [t["ansible.builtin.import_tasks"] for t in block["block"]] == ["steps.yml"]
    assert [t["ansible.builtin.import_tasks"] for t in block["rescue"]] == ["rescue.yml"]
    steps = _included(_yaml("roles/sglang_rollout/tasks/steps.yml"))
    assert steps == [
        ("sglang_canary", "preflight"),
        ("sglang_canary", "fingerprint"),
        ("ddtree_runtime", "main"),
        ("ddtree_probe", "static"),
        ("sglang_service", "prepare"),
        ("sglang_rotation", "leave"),
        ("sglang_service", "apply"),
        ("ddtree_probe", "live"),
        ("sglang_rotation", "join"),
        ("sglang_canary", "record"),
    ]
    assert _included(_yaml("roles/sglang_rollout/tasks/shadow.yml")) == [
        ("sglang_service", "main"), ("ddtree_probe", "live"), ("sglang_canary", "compare"),
        ("sglang_canary", "traffic"), ("sglang_canary", "remove_shadow")]
    rescue = _yaml("roles/sglang_rollout/tasks/rescue.yml")
    assert [entry for _, entry in _included(rescue)] == [
        "remove_shadow", "diagnose", "remove_shadow", "fingerprint", "rollback", "record"]
    assert "ansible.builtin.fail" in rescue[-1]


def test_the_service_restarts_in_its_sequence_without_a_handler():
    assert not (REPO / "roles/sglang_service/handlers").exists()
    for path in (REPO / "roles/sglang_service/tasks").glob("*.yml"):
        for task in _tasks(yaml.safe_load(path.read_text())):
            assert "notify" not in task and task.get("ansible.builtin.meta") != "flush_handlers", path.name
    restart = [
        t
        for t in _yaml("roles/sglang_service/tasks/run.yml")
        if t.get("ansible.builtin.systemd_service", {}).get("state") == "restarted"
    ]
    assert len(restart) == 1 and restart[0]["ansible.builtin.systemd_service"]["daemon_reload"] is True


def test_one_way_to_the_checkout_and_to_its_code_on_the_controller():
    for path in [*(REPO / "roles").rglob("*.yml"), *(REPO / "ansible").glob("*.yml"), REPO / "deploy.yml"]:
        text = path.read_text()
        assert "playbook_dir" not in text and "role_path | dirname" not in text, path
        assert "PYTHONPATH" not in text, f"{path}: controller tasks run with ddtree_controller_env"
        for task in _tasks(yaml.safe_load(text) if "tasks" in path.parts else []):
            command = task.get("ansible.builtin.command")
            argv = str(command.get("argv", "") if isinstance(command, dict) else command)
            if "ansible_playbook_python" in argv and "-m" in argv:
                assert task["environment"] == "{{ ddtree_controller_env }}", (path, task["name"])
                assert task["delegate_to"] == "localhost" and task["become"] is False, (path, task["name"])
