"""fleet status/logs and diagnose HOST against real lab hosts (systemd + sshd in systemd-nspawn).

Each test works on units and files of its own name (ddtree-ft-*), so it never disturbs a deploy
running on the same lab hosts.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddtree_runtime.ops import fleet_ssh
from ddtree_runtime.ops.fleet_inventory import Target, load_targets

# In a parallel run, one worker runs this module with the rest of tests/conftest.py's lab-engine group, in
# file order on one lab: they share what a module deploys on ct129/ct130 (build A installs once).
pytestmark = pytest.mark.lab

MEM_LINE = ("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
            "Current value: mem_fraction_static=0.1")


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddtree_runtime", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def inventory(lab) -> str:
    return str(Path(lab.inventory_dir) / "hosts.yml")


@pytest.fixture
def host(inventory: str) -> Target:
    return load_targets(inventory)[0]


def _sh(t: Target, command: str) -> str:
    rc, out, err = fleet_ssh.run_remote(t, command)
    assert rc == 0, f"{command}: {err}"
    return out


@pytest.fixture
def units(host: Target) -> Iterator[dict[str, str]]:
    """A healthy unit with state and probe files, and a unit in a start-up crash loop."""
    tag = uuid.uuid4().hex[:6]
    names = {"ok": f"ddtree-ft-ok-{tag}", "loop": f"ddtree-ft-loop-{tag}"}
    state = {"unit": names["ok"], "profile": "shadow-small", "release": f"r-{tag}",
             "deployed_at": "2026-11-29T10:00:00Z"}
    probe = {"probe": "live", "ok": True, "cause": None, "time": time.time() - 90, "message": "ok",
             "checks": [], "handshake": {"status": "ok"}, "figures": {"accept_length": 3.25}}
    script = f"/run/{names['loop']}.sh"
    crash_script = f"#!/bin/sh\necho {shlex.quote(MEM_LINE)} >&2\nexit 1"  # dies like SGLang at start-up
    _sh(host, " && ".join([
        "mkdir -p /var/lib/ddtree/state /var/lib/ddtree/probe",
        f"echo {shlex.quote(json.dumps(state))} > /var/lib/ddtree/state/{names['ok']}.json",
        f"echo {shlex.quote(json.dumps(probe))} > /var/lib/ddtree/probe/{names['ok']}.json",
        f"systemd-run --unit={names['ok']} -p Description=fleet-test sleep 600",
        f"echo {shlex.quote(crash_script)} > {script}",
        f"chmod +x {script}",
        f"systemd-run --unit={names['loop']} -p Description=fleet-test -p Restart=on-failure "
        f"-p RestartSec=200ms -p StartLimitBurst=3 -p StartLimitIntervalSec=60 {script}",
    ]))
    for _ in range(50):  # until systemd gives up on the looping unit
        if "ActiveState=failed" in _sh(host, f"systemctl show {names['loop']} -p ActiveState"):
            break
        time.sleep(0.2)
    yield names
    both = f"{names['ok']} {names['loop']}"
    files = f"/var/lib/ddtree/state/{names['ok']}.json /var/lib/ddtree/probe/{names['ok']}.json"
    fleet_ssh.run_remote(host, f"systemctl stop {both}; systemctl reset-failed {both}; "
                               f"rm -f {script} {files}")


def test_status_rows_from_a_real_host(inventory: str, host: Target, units: dict[str, str]):
    res = _cli("fleet", "status", "-i", inventory, "-l", host.name, "--unit", units["ok"],
               "--unit", units["loop"], "--json")
    assert res.returncode == 0, res.stderr
    ok, loop = json.loads(res.stdout)["rows"]
    assert (ok["host"], ok["reachable"], ok["active"]) == (host.name, True, "active (running)")
    assert 0 < ok["uptime_seconds"] < 120
    assert (ok["profile"], ok["release"]) == ("shadow-small", f"r-{units['ok'].rsplit('-', 1)[1]}")
    assert ok["probe_ok"] is True and ok["accept_length"] == 3.25
    assert ok["gpu_memory"] is None  # no nvidia-smi on a lab host
    assert loop["active"] == "failed" and loop["restarts"] == 3

    table = _cli("fleet", "status", "-i", inventory, "-l", host.name, "--unit", units["ok"]).stdout
    print(table)  # the status table from the lab, for the closing note
    row = table.splitlines()[1]
    for cell in (host.name, units["ok"], "active (running)", "shadow-small", "pass (1m ago)", "3.25"):
        assert cell in row


def test_diagnose_host_names_the_crash_loop_cause(inventory: str, host: Target, units: dict[str, str]):
    res = _cli("diagnose", host.name, "-i", inventory, "--unit", units["loop"], "--json")
    assert res.returncode == 1, res.stderr
    doc = json.loads(res.stdout)
    assert doc["causes"] == ["mem_fraction_too_small", "crash_loop"]
    mem, loop = doc["findings"]
    assert mem["count"] == 3 and mem["evidence"].endswith(MEM_LINE)
    assert "mem_fraction_static=0.1" in mem["summary"] and "restart counter reached 3" in loop["summary"]


def test_logs_show_the_units_journal(inventory: str, host: Target, units: dict[str, str]):
    res = _cli("fleet", "logs", host.name, "-i", inventory, "--unit", units["loop"], "-n", "50")
    assert res.returncode == 0, res.stderr
    assert MEM_LINE in res.stdout and "Start request repeated too quickly" in res.stdout


def test_unreachable_host_is_a_row_not_a_crash(lab, inventory: str, host: Target, tmp_path: Path):
    # The lab inventory plus a host on the lab's own subnet where no machine answers.
    doc = (Path(inventory)).read_text()
    bogus = host.address.rsplit(".", 1)[0] + ".250"
    inv = tmp_path / "hosts.yml"
    hosts_key = "    gpu_hosts:\n      hosts:\n"
    inv.write_text(doc.replace(hosts_key, f"{hosts_key}        ct250:\n          ansible_host: {bogus}\n"))
    res = _cli("fleet", "status", "-i", str(inv), "-l", f"ct250:{host.name}", "--timeout", "3", "--json")
    assert res.returncode == 3, res.stderr
    rows = {r["host"]: r for r in json.loads(res.stdout)["rows"]}
    assert rows[host.name]["reachable"] is True
    assert rows["ct250"]["reachable"] is False and bogus in rows["ct250"]["error"]


def test_unknown_host_key_is_refused_under_strict_checking(host: Target, tmp_path: Path):
    # Same host, strict checking, an empty known_hosts: fleet must refuse, as ssh would.
    inv = tmp_path / "hosts.yml"
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    inv.write_text(
        "all:\n  hosts:\n"
        f"    {host.name}:\n      ansible_host: {host.address}\n      ansible_user: {host.user}\n"
        f"      ansible_ssh_private_key_file: {host.key_file}\n"
        f"      ansible_ssh_common_args: -o UserKnownHostsFile={empty} -o StrictHostKeyChecking=yes\n")
    res = _cli("fleet", "status", "-i", str(inv), "--json")
    assert res.returncode == 3
    (row,) = json.loads(res.stdout)["rows"]
    assert row["reachable"] is False and "host key unknown" in row["error"]
    assert empty.read_text() == ""  # nothing was added behind the operator's back


def test_status_of_a_deployed_service(lab, wheelhouse, inventory: str, host: Target):
    # The product's deploy (a no-op when this checkout is already live there, as after the canary tests).
    deploy = lab.ansible_playbook("deploy.yml", "-l", host.name)
    assert deploy.returncode == 0, deploy.stdout[-4000:] + deploy.stderr[-2000:]
    state = json.loads(_sh(host, "cat /var/lib/ddtree/state/sglang-qwen.json"))

    res = _cli("fleet", "status", "-i", inventory, "--json")
    assert res.returncode == 0, res.stderr
    rows = {r["host"]: r for r in json.loads(res.stdout)["rows"]}
    assert set(rows) == set(lab.hosts)  # every lab host has its row
    row = rows[host.name]
    assert row["active"] == "active (running)" and row["uptime_seconds"] > 0
    assert (row["profile"], row["release"]) == (state["profile"], state["release"])
    assert row["probe_ok"] is True and row["accept_length"] >= 1.2  # the deploy's live probe
    table = _cli("fleet", "status", "-i", inventory).stdout
    print(f"\n{table}")  # the status table from the lab, for the closing note

    # the same host's metrics, from the release the unit runs
    text = _sh(host, f"{state['release_dir']}/bin/ddtree metrics show")
    assert 'ddtree_probe_success{probe="live",unit="sglang-qwen"} 1.0' in text
    info = f'profile="{state["profile"]}",release="{state["release"]}",unit="sglang-qwen"'
    assert f"ddtree_deploy_info{{{info}}} 1.0" in text
    assert 'ddtree_unit_active{unit="sglang-qwen"} 1.0' in text
