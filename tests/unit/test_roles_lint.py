"""yamllint and ansible-lint (production profile, offline) are clean on playbooks, roles, inventories."""

from __future__ import annotations

import subprocess

from tests.unit._ansible import BIN, REPO, tool_env


def test_yamllint_is_clean():
    result = subprocess.run([str(BIN / "yamllint"), "--strict", "."], cwd=REPO, env=tool_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ansible_lint_production_profile_is_clean():
    result = subprocess.run([str(BIN / "ansible-lint"), "--offline", "--profile", "production", "--nocolor"],
                            cwd=REPO, env=tool_env(), capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "Profile 'production' was required, and it passed" in output


def test_deploy_playbook_syntax():
    for inventory in ("inventories/production", "inventories/lab"):
        cmd = [str(BIN / "ansible-playbook"), "--syntax-check", "-i", inventory, "deploy.yml"]
        result = subprocess.run(cmd, cwd=REPO, env=tool_env(), capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
