"""The lab hosts themselves: real systemd as PID 1, sshd with the lab key, ansible's systemd module,
idempotent up, and a down that removes exactly what up made."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ddtree_runtime.ops.labhosts import net as lab_net
from ddtree_runtime.ops.labhosts import nspawn as lab_nspawn
from ddtree_runtime.ops.labhosts.spec import WHEELHOUSE_MOUNT, Lab
from tests.lab.conftest import REPO, LabHandle, ddtree, require_lab

pytestmark = pytest.mark.lab


def _status(name: str) -> dict:
    proc = ddtree("lab", "status", "--name", name, "--json", timeout=120)
    return json.loads(proc.stdout)


def test_up_twice_keeps_the_running_machines(lab: LabHandle) -> None:
    before = {h["host"]: h["nspawn_pid"] for h in _status(lab.name)["hosts"]}
    again = ddtree("lab", "up", "--name", lab.name, "--hosts", "2", timeout=300)
    assert again.returncode == 0, again.stderr
    for host in lab.hosts:
        assert f"{host}: already running" in again.stderr
    after = _status(lab.name)
    assert after["up"] is True
    assert {h["host"]: h["nspawn_pid"] for h in after["hosts"]} == before
    assert all(pid is not None for pid in before.values())


def test_status_reports_each_host(lab: LabHandle) -> None:
    report = _status(lab.name)
    assert [h["host"] for h in report["hosts"]] == lab.hosts
    for h in report["hosts"]:
        assert h["address"] == lab.addresses[h["host"]]
        assert h["state"] == "running"
        assert h["system"] in ("running", "degraded")


def test_hosts_boot_systemd_as_pid1_with_their_own_identity(lab: LabHandle) -> None:
    machine_ids = set()
    for host in lab.hosts:
        proc = lab.ssh(host, "cat /proc/1/comm; hostname; systemctl is-system-running; cat /etc/machine-id")
        assert proc.returncode in (0, 1), proc.stderr  # is-system-running exits 1 when degraded
        comm, hostname, state, machine_id = proc.stdout.split()
        assert (comm, hostname) == ("systemd", host)
        assert state in ("running", "degraded")
        machine_ids.add(machine_id)
    assert len(machine_ids) == len(lab.hosts)


def test_ssh_checks_host_keys_and_hosts_reach_each_other(lab: LabHandle) -> None:
    # The known_hosts file up wrote holds each host's real key: strict checking passes without a prompt.
    first, second = lab.hosts[:2]
    spec_host = lab.spec.hosts[0]
    strict = [a.replace("accept-new", "yes") for a in lab.spec.ssh_argv(spec_host, "true")]
    assert subprocess.run(strict, capture_output=True, timeout=60, check=False).returncode == 0
    probe = f"python3 -c \"import socket; socket.create_connection(('{second}', 22), 3); print('ok')\""
    proc = lab.ssh(first, probe)
    assert proc.stdout.strip() == "ok", proc.stderr


def test_hosts_have_no_route_outside_the_lab(lab: LabHandle) -> None:
    for host in lab.hosts:
        routes = lab.ssh(host, "ip -4 route show").stdout.splitlines()
        assert routes, "no route at all: the host's eth0 is not configured"
        assert all(r.startswith(f"10.213.{lab.spec.k}.0/24 dev eth0 ") for r in routes), routes


def test_wheelhouse_is_mounted_read_only(lab: LabHandle) -> None:
    proc = lab.ssh(lab.hosts[0], f"test -d {WHEELHOUSE_MOUNT} && touch {WHEELHOUSE_MOUNT}/probe")
    assert proc.returncode != 0
    assert "Read-only file system" in proc.stderr


def test_ansible_systemd_service_starts_and_stops_a_unit(lab: LabHandle) -> None:
    unit = f"ddtree-labcheck-{uuid.uuid4().hex[:6]}.service"
    host = lab.hosts[0]
    body = "[Unit]\\nDescription=lab check\\n[Service]\\nExecStart=/bin/sleep infinity\\n"
    assert lab.ssh(host, f"printf '{body}' > /etc/systemd/system/{unit}").returncode == 0
    try:
        started = lab.ansible(host, "-m", "ansible.builtin.systemd_service",
                              "-a", f"name={unit} state=started daemon_reload=true")  # fmt: skip
        assert started.returncode == 0, started.stdout + started.stderr
        assert "CHANGED" in started.stdout
        assert lab.ssh(host, f"systemctl is-active {unit}").stdout.strip() == "active"
        again = lab.ansible(host, "-m", "ansible.builtin.systemd_service", "-a", f"name={unit} state=started")
        assert again.returncode == 0 and "SUCCESS" in again.stdout, again.stdout
        stopped = lab.ansible(
            host, "-m", "ansible.builtin.systemd_service", "-a", f"name={unit} state=stopped"
        )
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert lab.ssh(host, f"systemctl is-active {unit}").stdout.strip() == "inactive"
    finally:
        lab.ssh(host, f"systemctl stop {unit}; rm -f /etc/systemd/system/{unit}; systemctl daemon-reload")


def _artefacts(spec: Lab) -> dict[str, set[str]]:
    """Everything of `spec` that exists on the controller right now."""
    # Processes inside a host share its network namespace (their /proc/PID/root is in another mount ns).
    netns_inodes = {
        os.stat(lab_net.NETNS_DIR / h.netns).st_ino for h in spec.hosts if lab_net.netns_exists(h.netns)
    }
    processes = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                inode = os.stat(entry / "ns/net").st_ino
            except OSError:
                continue
            if inode in netns_inodes:
                processes.add(entry.name)
    for h in spec.hosts:
        processes |= {str(p) for p in lab_nspawn.nspawn_pids(h.machine)}
    return {
        "netns": {
            ns for ns in lab_net.netns_names() if re.fullmatch(re.escape(spec.netns_prefix) + r"ct\d+", ns)
        },
        "links": lab_net.link_names() & {spec.bridge, *(h.veth for h in spec.hosts)},
        "mounts": {str(m) for m in lab_nspawn.mounts_under(spec.state_dir)}
        if spec.state_dir.exists()
        else set(),
        "processes": processes,
        "files": {str(spec.state_dir)} if spec.state_dir.exists() else set(),
    }


def test_down_removes_what_up_made_and_nothing_else(lab: LabHandle) -> None:
    require_lab()
    spec = Lab(f"{lab.name[:12]}-dn", 1)
    assert spec.k != lab.spec.k, "the scratch lab must not share the session lab's subnet"
    ddtree("lab", "down", "--name", spec.name)  # a leftover from an interrupted run
    assert not any(_artefacts(spec).values())
    # A namespace of another lab whose name starts like this one's: down must leave it alone.
    neighbour = f"{spec.netns_prefix}x-{spec.hosts[0].name}"
    assert not lab_net.netns_exists(neighbour)
    lab_net._ip("netns", "add", neighbour)
    try:
        up = ddtree("lab", "up", "--name", spec.name, "--hosts", "1", timeout=600)
        assert up.returncode == 0, up.stderr
        made = _artefacts(spec)
        assert made["netns"] == {spec.hosts[0].netns}
        assert made["links"] == {spec.bridge, spec.hosts[0].veth}
        assert str(spec.hosts[0].root) in made["mounts"]
        assert len(made["processes"]) >= 3  # nspawn, the container's systemd, sshd at least

        down = ddtree("lab", "down", "--name", spec.name, timeout=300)
        assert down.returncode == 0, down.stderr
        assert _artefacts(spec) == {key: set() for key in made}
        assert lab_net.netns_exists(neighbour)
        # The session's lab (another subnet, other machines) is untouched.
        assert _status(lab.name)["up"] is True
        again = ddtree("lab", "down", "--name", spec.name)
        assert again.returncode == 0, again.stderr
    finally:
        lab_net.delete_netns(neighbour)
        ddtree("lab", "down", "--name", spec.name)


def _ddtree_from(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DDTREE_REPO": str(repo)}
    return subprocess.run(
        [sys.executable, "-m", "ddtree_runtime", *args], cwd=repo, env=env,
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


def test_a_lab_of_another_checkout_is_refused_while_live_and_taken_over_once_stopped(
    lab: LabHandle, tmp_path: Path
) -> None:
    # CI runs in a fresh clone after a session whose machines were killed: their namespaces and bridge stay.
    other = tmp_path / "clone"
    (other / "inventories/lab").mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", other)
    spec = Lab(f"{lab.name[:12]}-co", 1)
    ddtree("lab", "down", "--name", spec.name)
    try:
        assert _ddtree_from(other, "lab", "up", "--name", spec.name, "--hosts", "1").returncode == 0
        live = ddtree("lab", "up", "--name", spec.name, "--hosts", "1")
        assert live.returncode == 1
        assert f"belongs to 'ddtree-lab:{spec.name}:{other}" in live.stderr
        refused = ddtree("lab", "down", "--name", spec.name)
        assert refused.returncode == 1 and "bring it down from there" in refused.stderr
        assert _status_from(other, spec.name)["up"] is True

        for pid in lab_nspawn.nspawn_pids(spec.hosts[0].machine):
            os.kill(pid, signal.SIGKILL)  # what the end of a session does to it
        taken = ddtree("lab", "up", "--name", spec.name, "--hosts", "1")
        assert taken.returncode == 0, taken.stderr
        assert "removing the bridge and namespaces a stopped lab" in taken.stderr
        assert _status(spec.name)["up"] is True
    finally:
        ddtree("lab", "down", "--name", spec.name)
        _ddtree_from(other, "lab", "down", "--name", spec.name)  # unmounts the clone's stale overlay
    assert not lab_nspawn.mounts_under(other)
    assert not any(_artefacts(spec).values())


def _status_from(repo: Path, name: str) -> dict:
    return json.loads(_ddtree_from(repo, "lab", "status", "--name", name, "--json").stdout)


def test_labs_whose_names_share_a_subnet_refuse_while_live_and_take_over_once_stopped(lab: LabHandle) -> None:
    first = Lab(f"{lab.name[:10]}-sa", 1)
    second = next(
        Lab(f"{lab.name[:10]}-s{i}", 1)
        for i in range(100_000)
        if Lab(f"{lab.name[:10]}-s{i}", 1).k == first.k
    )
    for spec in (first, second):
        ddtree("lab", "down", "--name", spec.name)
    try:
        assert ddtree("lab", "up", "--name", first.name, "--hosts", "1").returncode == 0
        clash = ddtree("lab", "up", "--name", second.name, "--hosts", "1")
        assert clash.returncode == 1
        assert "another lab uses this subnet" in clash.stderr and first.name in clash.stderr
        assert _status(first.name)["up"] is True

        for pid in lab_nspawn.nspawn_pids(first.hosts[0].machine):
            os.kill(pid, signal.SIGKILL)
        taken = ddtree("lab", "up", "--name", second.name, "--hosts", "1")
        assert taken.returncode == 0, taken.stderr
        assert f"a stopped lab {first.name!r}" in taken.stderr
        assert _status(second.name)["up"] is True
    finally:
        for spec in (second, first):
            ddtree("lab", "down", "--name", spec.name)
    for spec in (first, second):
        assert not any(_artefacts(spec).values())


def test_a_stopped_host_powers_on_with_its_disk(lab: LabHandle) -> None:
    """`up` after a host went down boots it again with what it had on disk, as a real host after a power
    cut (the rollout tests stop a host mid-play and expect its release back)."""
    spec = Lab(f"{lab.name[:12]}-pw", 1)
    (host,) = spec.hosts
    ddtree("lab", "down", "--name", spec.name)
    try:
        assert ddtree("lab", "up", "--name", spec.name, "--hosts", "1", timeout=600).returncode == 0
        marker = "/var/lib/ddtree-power-test"
        # `sync FILE` flushes the marker alone: a bare `sync` flushes every filesystem of the machine and
        # waited past the timeout while the other worker's lab wrote release venvs (CI run, issue 24).
        ssh = spec.ssh_argv(host, f"echo before-the-cut > {marker} && sync {marker} && cat /etc/machine-id")
        first = subprocess.run(ssh, capture_output=True, text=True, timeout=60)
        assert first.returncode == 0, first.stderr
        lab_nspawn.stop(host)
        again = ddtree("lab", "up", "--name", spec.name, "--hosts", "1", timeout=600)
        assert again.returncode == 0, again.stderr
        assert "its disk kept" in again.stderr
        read = subprocess.run(spec.ssh_argv(host, f"cat {marker} /etc/machine-id"), capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert read.returncode == 0, read.stderr  # the same host key: known_hosts still matches
        assert read.stdout.split() == ["before-the-cut", first.stdout.strip()]
    finally:
        ddtree("lab", "down", "--name", spec.name)
    assert not any(_artefacts(spec).values())
