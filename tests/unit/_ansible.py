"""Helpers for tests that run the real ansible-playbook against localhost."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PLAYBOOKS = Path(__file__).parent / "playbooks"


def tool_env() -> dict[str, str]:
    """The venv's bin first on PATH (ansible-lint shells out to ansible-config), config from the repo."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["ANSIBLE_CONFIG"] = str(REPO / "ansible.cfg")
    env["ANSIBLE_NOCOLOR"] = "1"
    return env


def playbook(path: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    cmd = [str(BIN / "ansible-playbook"), "-i", "localhost,", str(path), *args]
    return subprocess.run(cmd, cwd=REPO, env=tool_env(), capture_output=True, text=True, timeout=timeout)
