"""Exposure defaults (docs/runbook.md, "Exposure"): SGLang and the exporter on loopback unless an allow-list
names who may connect (kernel-enforced by systemd's IPAddressDeny/IPAddressAllow); the periodic probe
unprivileged, journal-reading, with a start timeout. Through the roles' own preflight and templates
(real ansible-playbook), then systemd-analyze on the rendered units."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.unit._ansible import PLAYBOOKS, REPO, playbook

analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")


def _render_exporter(tmp_path: Path, **extra: object) -> tuple[subprocess.CompletedProcess, Path]:
    release, out = tmp_path / "release", tmp_path / "out"
    (release / "bin").mkdir(parents=True)
    (release / "bin" / "ddtree").symlink_to(shutil.which("python3") or "/usr/bin/python3")
    out.mkdir()
    res = playbook(PLAYBOOKS / "render_exporter.yml", "-e", f"out_dir={out}",
                   "-e", f"ddtree_exporter_release_dir={release}", "-e", json.dumps(extra))
    return res, out


def _directives(text: str, name: str) -> list[str]:
    return [line.split("=", 1)[1] for line in text.splitlines() if line.startswith(f"{name}=")]


def _security(unit: Path) -> float:
    res = subprocess.run(["systemd-analyze", "security", "--offline=true", unit.name], cwd=unit.parent,
                         capture_output=True, text=True, timeout=60)
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", res.stdout)
    assert match, res.stdout[-2000:] + res.stderr
    print(f"systemd-analyze security --offline=true {unit.name}: {match.group(1)}")
    return float(match.group(1))


@pytest.fixture(scope="module")
def exporter_units(tmp_path_factory) -> Path:
    res, out = _render_exporter(tmp_path_factory.mktemp("exporter"))
    assert res.returncode == 0, res.stdout[-3000:]
    return out


def test_exporter_listens_on_loopback_and_filters_by_default(exporter_units: Path) -> None:
    text = (exporter_units / "ddtree-exporter.service").read_text()
    assert " metrics serve --listen 127.0.0.1:9433 " in text
    assert _directives(text, "IPAddressDeny") == ["any"]
    assert _directives(text, "IPAddressAllow") == ["localhost"]


def test_probe_unit_is_unprivileged_reads_the_journal_and_cannot_hang(exporter_units: Path) -> None:
    text = (exporter_units / "ddtree-probe@sglang-qwen.service").read_text()
    assert _directives(text, "User") == ["ddtree-probe"]
    assert _directives(text, "CapabilityBoundingSet") == [""]
    assert _directives(text, "SupplementaryGroups") == ["systemd-journal"]
    assert _directives(text, "ReadWritePaths") == ["/var/lib/ddtree/probe"]
    assert _directives(text, "IPAddressAllow") == ["localhost"]  # it probes loopback only
    # readiness 120 s + 13 request deadlines x 60 s (/tokenize, 3 answers one at a time, the batch at once,
    # 6 lossless checks: one per answer, /server_info, /metrics) + a margin: the probe's deadlines end first
    assert _directives(text, "TimeoutStartSec") == ["960"]
    assert "--request-timeout ${DDTREE_PROBE_REQUEST_TIMEOUT}" in text


@analyze
def test_units_verify_clean_and_score_low(exporter_units: Path) -> None:
    for name in ("ddtree-exporter.service", "ddtree-probe@sglang-qwen.service"):
        res = subprocess.run(["systemd-analyze", "verify", name], cwd=exporter_units, capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 0 and not (res.stdout + res.stderr).strip(), res.stdout + res.stderr
    assert _security(exporter_units / "ddtree-exporter.service") <= 1.6
    assert _security(exporter_units / "ddtree-probe@sglang-qwen.service") <= 2.0  # was 6.1 as root


def test_exporter_on_other_addresses_needs_an_allow_list(tmp_path: Path) -> None:
    res, _ = _render_exporter(tmp_path / "a", ddtree_exporter_listen_address="0.0.0.0")
    assert res.returncode != 0
    assert "0.0.0.0 serves other machines, so name them" in " ".join(res.stdout.split())
    res, out = _render_exporter(tmp_path / "b", ddtree_exporter_listen_address="::",
                                ddtree_exporter_allowed_clients=["10.0.5.12/32", "fd00::/8"])
    assert res.returncode == 0, res.stdout[-3000:]
    text = (out / "ddtree-exporter.service").read_text()
    assert " --listen [::]:9433 " in text
    assert _directives(text, "IPAddressAllow") == ["localhost 10.0.5.12/32 fd00::/8"]
    res, _ = _render_exporter(tmp_path / "d", ddtree_exporter_listen_address="0.0.0.0",
                              ddtree_exporter_allowed_clients=["10.0.0.0/8 ; rm -rf /"])
    assert res.returncode != 0


def _render_sglang(tmp_path: Path, **extra: object) -> tuple[subprocess.CompletedProcess, Path]:
    (tmp_path / "balanced").mkdir(parents=True)
    res = playbook(PLAYBOOKS / "render_units.yml", "-e", f"out_dir={tmp_path}",
                   "-e", "sglang_service_release_dir=/opt/ddtree/releases/x",
                   "-e", f"sglang_service_unit_template={REPO}/templates/sglang-qwen.service.j2",
                   "-e", f"sglang_service_env_template={REPO}/templates/sglang-qwen.env.j2",
                   "-e", json.dumps({"profiles": ["balanced"], **extra}))
    return res, tmp_path / "balanced" / "sglang-qwen.service"


def test_sglang_beyond_loopback_only_with_an_allow_list(tmp_path: Path) -> None:
    res, _ = _render_sglang(tmp_path / "a", sglang_service_host="0.0.0.0")
    assert res.returncode != 0 and "SGLang's API has no authentication" in " ".join(res.stdout.split())
    res, _ = _render_sglang(tmp_path / "b", sglang_service_host="10.0.4.7",
                            sglang_service_allowed_clients=["any"])
    assert res.returncode != 0  # one other address alone: the probes on 127.0.0.1 could not reach it
    res, unit = _render_sglang(tmp_path / "c", sglang_service_host="0.0.0.0",
                               sglang_service_allowed_clients=["10.0.4.0/24"])
    assert res.returncode == 0, res.stdout[-3000:]
    text = unit.read_text()
    assert "--host 0.0.0.0" in text
    assert _directives(text, "IPAddressDeny") == ["any"]
    assert _directives(text, "IPAddressAllow") == ["localhost 10.0.4.0/24"]


def test_lab_and_production_inventories_state_their_exposure() -> None:
    import yaml

    lab = yaml.safe_load((REPO / "inventories/lab/group_vars/all.yml").read_text())
    assert lab["sglang_service_host"] == "0.0.0.0"
    assert lab["sglang_service_allowed_clients"] == ["10.213.0.0/16"]
    assert lab["ddtree_exporter_allowed_clients"] == ["10.213.0.0/16"]
    for path in (REPO / "inventories/production").rglob("*.yml"):
        doc = yaml.safe_load(path.read_text()) or {}
        assert "any" not in (doc.get("sglang_service_allowed_clients") or []), path
    runbook = (REPO / "docs/runbook.md").read_text()
    for name in ("sglang_service_host", "sglang_service_allowed_clients", "ddtree_exporter_listen_address",
                 "ddtree_exporter_allowed_clients", "ddtree_exporter_probe_user"):
        assert name in runbook, name
