"""Session fixtures for `@pytest.mark.lab` tests: real systemd-nspawn hosts reached over SSH.

`lab` brings a lab up once per session (name from DDTREE_LAB_NAME, default "test"; 3 hosts) with the
real `ddtree lab up` command and takes it down at the end, unless DDTREE_LAB_KEEP=1 or another live
test session is still using the same lab (sessions that share a checkout register under .lab/.users/).
Under pytest-xdist every worker is a session with a lab of its own, NAME-gw0, NAME-gw1, ... (own
subnet, hosts and inventory): the suites each worker runs never meet another worker's hosts.
Without root or systemd-nspawn the lab tests skip, except under CI=true, where they must run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddtree_runtime.ops.labhosts.spec import NAME_MAX, Lab, lab_dir, repo_root

REPO = repo_root()
BIN = Path(sys.executable).parent
LAB_HOSTS = 3
# ct131 runs the real SGLang server on CPU (inventories/lab/host_vars/ct131.yml): slow to start, so the
# lab-engine scenarios use the other hosts (LabHandle.lab_engine_hosts) and tests/lab/test_real_sglang_lab.py
# deploys it.
REAL_SGLANG_HOST = "ct131"


def ddtree(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """Run the real CLI (a separate process, so the machines it starts are not this process's children)."""
    return subprocess.run(
        [sys.executable, "-m", "ddtree_runtime", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "lab hosts need root (network namespaces, mounts, systemd-nspawn)"
    if shutil.which("systemd-nspawn") is None or shutil.which("debootstrap") is None:
        proc = subprocess.run(["bash", str(REPO / "scripts/lab/prereqs.sh")], capture_output=True, text=True)
        if proc.returncode != 0 or shutil.which("systemd-nspawn") is None:
            return (
                f"systemd-nspawn unavailable and scripts/lab/prereqs.sh failed: {proc.stderr.strip()[-500:]}"
            )
    return None


def require_lab() -> None:
    """Skip (or, under CI, fail) when lab hosts cannot run here."""
    reason = _unavailable()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the lab tests: {reason}")
    pytest.skip(reason)


@dataclass
class LabHandle:
    """What a lab test needs: host names and addresses, the inventory, ssh and ansible helpers."""

    spec: Lab

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def hosts(self) -> list[str]:
        return [h.name for h in self.spec.hosts]

    @property
    def lab_engine_hosts(self) -> list[str]:
        """The hosts that run the lab engine (every host but the real-SGLang one)."""
        return [h for h in self.hosts if h != REAL_SGLANG_HOST]

    @property
    def addresses(self) -> dict[str, str]:
        return {h.name: h.address for h in self.spec.hosts}

    @property
    def inventory(self) -> Path:
        """The lab's inventory folder (hosts.yml + group_vars/host_vars linked from inventories/lab/)."""
        return self.spec.inventory_dir

    @property
    def inventory_dir(self) -> Path:
        return self.spec.inventory_dir

    def ssh(self, host: str, cmd: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        (target,) = [h for h in self.spec.hosts if h.name == host]
        return subprocess.run(
            self.spec.ssh_argv(target, cmd), capture_output=True, text=True, timeout=timeout, check=False
        )

    def _ansible_env(self) -> dict[str, str]:
        return {
            **os.environ,
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_FORCE_COLOR": "0",
            "PATH": f"{BIN}:{os.environ['PATH']}",
        }

    def ansible_playbook(self, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess[str]:
        """The repo's ansible-playbook against this lab's inventory, from the checkout (ansible.cfg there)."""
        return subprocess.run(
            [str(BIN / "ansible-playbook"), "-i", str(self.inventory), *args],
            cwd=REPO, env=self._ansible_env(), capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip

    def ansible(self, pattern: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """An ad-hoc `ansible PATTERN ARGS` against this lab's inventory."""
        return subprocess.run(
            [str(BIN / "ansible"), "-i", str(self.inventory), pattern, *args],
            cwd=REPO, env=self._ansible_env(), capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip


def lab_name() -> str:
    """DDTREE_LAB_NAME (default "test"), plus the xdist worker's id when there is one."""
    base = os.environ.get("DDTREE_LAB_NAME", "test")
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...: set by pytest-xdist in its workers
    if not worker:
        return base
    return f"{base[: NAME_MAX - len(worker) - 1]}-{worker}"


def _users_dir(name: str) -> Path:
    return lab_dir() / ".users" / name


def _other_live_users(name: str) -> list[int]:
    users = _users_dir(name)
    live = []
    for entry in users.iterdir() if users.is_dir() else ():
        pid = int(entry.name)
        if pid != os.getpid() and Path(f"/proc/{pid}").exists():
            live.append(pid)
        elif pid != os.getpid():
            entry.unlink(missing_ok=True)  # a session that died without cleaning up
    return live


@pytest.fixture(scope="session")
def lab() -> Iterator[LabHandle]:
    require_lab()
    name = lab_name()
    users = _users_dir(name)
    users.mkdir(parents=True, exist_ok=True)
    (users / str(os.getpid())).touch()
    up = ddtree("lab", "up", "--name", name, "--hosts", str(LAB_HOSTS))
    if up.returncode != 0:
        (users / str(os.getpid())).unlink(missing_ok=True)
        pytest.fail(f"`ddtree lab up --name {name}` failed (rc {up.returncode}):\n{up.stderr[-3000:]}")
    yield LabHandle(Lab(name, LAB_HOSTS))
    (users / str(os.getpid())).unlink(missing_ok=True)
    if os.environ.get("DDTREE_LAB_KEEP") == "1" or _other_live_users(name):
        return
    down = ddtree("lab", "down", "--name", name)
    assert down.returncode == 0, f"`ddtree lab down --name {name}` failed:\n{down.stderr}"


@pytest.fixture(scope="session")
def wheelhouse() -> Path:
    """.lab/wheelhouse/ filled (reused when the requirements are unchanged; the project wheel is rebuilt)."""
    proc = ddtree("lab", "wheelhouse")
    assert proc.returncode == 0, f"`ddtree lab wheelhouse` failed:\n{proc.stderr[-3000:]}"
    return lab_dir() / "wheelhouse"
