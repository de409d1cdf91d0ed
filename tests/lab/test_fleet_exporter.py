"""roles/ddtree_exporter on a real lab host: the exporter unit (hardened, own system user) is scraped from
the controller, the periodic probe unit writes its report, a second run changes nothing.

The release is a small venv of this checkout's wheel plus prometheus_client (from the lab wheelhouse),
enough for `ddtree metrics` and `ddtree probe`; units and files carry this test's own names.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ddtree_runtime.ops import fleet_ssh
from ddtree_runtime.ops.fleet_inventory import Target, load_targets

pytestmark = pytest.mark.lab
REPO = Path(__file__).resolve().parents[2]


def _sh(t: Target, command: str) -> str:
    rc, out, err = fleet_ssh.run_remote(t, command)
    assert rc == 0, f"{command}: {out}{err}"
    return out


def _wheel(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "ddtree_runtime", src / "ddtree_runtime",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp / "whl"), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp / "whl").glob("ddtree_runtime-*.whl")
    return wheel


@pytest.fixture
def host(lab) -> Target:
    return load_targets(str(Path(lab.inventory_dir) / "hosts.yml"))[0]


@pytest.fixture
def release(host: Target, tmp_path: Path) -> Iterator[str]:
    tag = uuid.uuid4().hex[:6]
    rel = f"/opt/ddtree/releases/ft-exporter-{tag}"
    wheel = _wheel(tmp_path)
    client = fleet_ssh.open_client(host)
    try:
        _sh(host, f"mkdir -p {rel} && python3 -m venv {rel}")
        with client.open_sftp() as sftp:
            sftp.put(str(wheel), f"{rel}/{wheel.name}")
    finally:
        client.close()
    _sh(host, f"{rel}/bin/pip install -q --no-index --no-deps {rel}/{wheel.name} "
              "/srv/wheelhouse/prometheus_client-*.whl")
    yield rel
    fleet_ssh.run_remote(host, f"rm -rf {rel}")


def _playbook(lab, *args: str) -> subprocess.CompletedProcess:
    res = lab.ansible_playbook("ansible/exporter.yml", *args)
    return res


def _scrape(url: str, timeout: float = 10) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_exporter_role_installs_a_scrapable_hardened_exporter(lab, host: Target, release: str):
    tag = release.rsplit("-", 1)[1]
    unit, port = f"ddtree-ft-exp-{tag}", 9400 + int(tag, 16) % 90
    dead_port = 30900 + int(tag, 16) % 90  # nothing listens there: the periodic probe must say so
    extra = json.dumps({"ddtree_exporter_release_dir": release, "ddtree_exporter_port": port,
                        "ddtree_exporter_probe_units": [{"unit": unit, "port": dead_port}],
                        "ddtree_exporter_probe_timeout": 2})
    try:
        # a "server" whose journal names a known failure: the unprivileged probe must read it
        _sh(host, f"systemd-run --unit={unit} -p Description=exporter-test sh -c "
                  "'echo \"OSError: [Errno 98] Address already in use\"; exec sleep 600' && "
                  f"{release}/bin/ddtree metrics record-rollout --unit {unit} --outcome rolled_back "
                  f"--release r-{tag} --cause port_in_use")
        first = _playbook(lab, "-l", host.name, "-e", extra)
        assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]

        # the timer's service, run now: nothing answers on the port, and the unit's journal says why
        _sh(host, f"systemctl start ddtree-probe@{unit}.service")
        report = json.loads(_sh(host, f"cat /var/lib/ddtree/probe/{unit}.json"))
        assert (report["ok"], report["cause"], report["exit_code"]) == (False, "port_in_use", 3), report
        # read from the journal, by the unprivileged probe user that owns the report
        assert [f["cause"] for f in report["figures"]["diagnosis"]] == ["port_in_use"]
        assert _sh(host, f"stat -c %U /var/lib/ddtree/probe/{unit}.json").strip() == "ddtree-probe"
        rc, out, err = fleet_ssh.run_remote(host, f"{release}/bin/ddtree diagnose --unit {unit} --json")
        assert rc == 1 and json.loads(out)["causes"] == ["port_in_use"], err  # the CLI on a real journal

        s = _scrape(f"http://{host.address}:{port}/metrics")  # from the controller, over the lab net
        u = ("unit", unit)
        assert s[("ddtree_rollouts_total", (("outcome", "rolled_back"), u))] == 1.0
        assert s[("ddtree_probe_success", (("probe", "live"), u))] == 0.0
        assert s[("ddtree_probe_failure_info", (("cause", "port_in_use"), ("probe", "live"), u))] == 1.0
        assert s[("ddtree_unit_active", (u,))] == 1.0  # systemd asked over D-Bus, unprivileged
        assert 0 < s[("ddtree_unit_uptime_seconds", (u,))] < 600

        second = _playbook(lab, "-l", host.name, "-e", extra)
        assert second.returncode == 0 and re.search(r"changed=0\s", second.stdout), second.stdout[-3000:]

        check = _playbook(lab, "-l", host.name, "-e", extra, "--check", "--diff")
        assert check.returncode == 0 and re.search(r"changed=0\s", check.stdout), check.stdout[-3000:]

        _sh(host, "systemd-analyze verify /etc/systemd/system/ddtree-exporter.service "
                  "/etc/systemd/system/ddtree-probe@.service /etc/systemd/system/ddtree-probe@.timer")
        for name, limit in (("ddtree-exporter.service", 2.0), (f"ddtree-probe@{unit}.service", 2.0)):
            security = _sh(host, f"systemd-analyze security {name} --no-pager | tail -1")
            print(f"{name} {security.strip()}")
            exposure = float(re.search(r"exposure level .*?: *([0-9.]+)", security).group(1))
            assert exposure < limit, security

        # The allow-list is the kernel's (cgroup v2 BPF): a scraper not on it gets no answer, the host does.
        if _sh(host, "stat -fc %T /sys/fs/cgroup").strip() != "cgroup2fs":
            print("lab host on cgroup v1: systemd cannot enforce IPAddressAllow here (production hosts can)")
        else:
            narrow = json.dumps({**json.loads(extra), "ddtree_exporter_allowed_clients": ["192.0.2.1/32"]})
            assert _playbook(lab, "-l", host.name, "-e", narrow).returncode == 0
            with pytest.raises(OSError):
                _scrape(f"http://{host.address}:{port}/metrics", timeout=3)
            _sh(host, f"{release}/bin/python -c \"import urllib.request as u; "
                      f"u.urlopen('http://127.0.0.1:{port}/metrics', timeout=10)\"")
    finally:
        units = "/etc/systemd/system/ddtree-exporter.service /etc/systemd/system/ddtree-probe@.*"
        files = (f"/etc/ddtree/probe/{unit}.env /var/lib/ddtree/probe/{unit}.json "
                 f"/var/lib/ddtree/rollout/{unit}.json /var/lib/ddtree/rollout/{unit}.lock")
        fleet_ssh.run_remote(host, f"systemctl stop {unit} ddtree-probe@{unit}.timer ddtree-exporter; "
                               f"systemctl disable ddtree-exporter ddtree-probe@{unit}.timer; "
                               f"systemctl reset-failed {unit}; rm -f {units} {files}; "
                               "systemctl daemon-reload")


def test_exporter_role_refuses_bad_variables_before_any_change(lab, host: Target):
    res = _playbook(lab, "-l", host.name, "-e", '{"ddtree_exporter_port": 70000, '
                    '"ddtree_exporter_release_dir": "/nonexistent"}')
    assert res.returncode != 0
    assert "ddtree_exporter_port: 70000 is out of range: 1..65535" in res.stdout
    assert "FileNotFoundError" not in res.stdout
    _, out, _ = fleet_ssh.run_remote(host, "test -e /etc/systemd/system/ddtree-exporter.service; echo $?")
    assert out.strip() == "1"
