"""roles/sglang_router: the unit it renders (the pinned release in its own venv, hardened, loopback or an
allow-list that also admits the workers, the control key only in the 0600 env file) and the inputs its
preflight refuses before anything changes. Through the role's own preflight and templates (real
ansible-playbook), then systemd-analyze on the rendered unit; the rotation role's fallbacks for a router
host's unset variables equal the router role's defaults."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.unit._ansible import PLAYBOOKS, REPO, playbook

KEY = "a-control-key-of-24-chars"
analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")


def _render(tmp_path: Path, **extra: object) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    out.mkdir(parents=True)
    res = playbook(PLAYBOOKS / "render_router.yml", "-e", f"out_dir={out}", "-e", json.dumps(extra))
    return res, out


def _directives(text: str, name: str) -> list[str]:
    return [line.split("=", 1)[1] for line in text.splitlines() if line.startswith(f"{name}=")]


def _said(res: subprocess.CompletedProcess) -> str:
    return " ".join(res.stdout.split())


@pytest.fixture(scope="module")
def exposed(tmp_path_factory) -> Path:
    """A router for clients of 10.0.4.0/24, metrics for them too, with a key, in front of w1 and w2."""
    res, out = _render(
        tmp_path_factory.mktemp("router"),
        sglang_router_listen_address="0.0.0.0",
        sglang_router_metrics_listen_address="0.0.0.0",
        sglang_router_allowed_clients=["10.0.4.0/24"],
        sglang_router_control_key=KEY,
        sglang_router_workers=["w1", "w2"],
        sglang_router_extra_flags=["--log-level info"],
    )
    assert res.returncode == 0, res.stdout[-3000:]
    return out


def test_the_unit_runs_the_pinned_router_and_admits_clients_and_workers(exposed: Path) -> None:
    text = (exposed / "sglang-router.service").read_text()
    assert "ExecStart=/opt/sglang-router/0.3.2/bin/smg launch" in text
    for flag in (
        "--host 0.0.0.0",
        "--port 30080",
        "--policy cache_aware",
        "--prometheus-port 29000",
        "--control-plane-api-keys ${SGLANG_ROUTER_CONTROL_KEYS}",
        "--log-level info",
        "--worker-urls $SGLANG_ROUTER_WORKER_URLS",
    ):
        assert flag in text, flag
    assert _directives(text, "IPAddressDeny") == ["any"]
    assert _directives(text, "IPAddressAllow") == ["localhost 10.0.4.0/24 10.0.7.1 10.0.7.2"]
    assert _directives(text, "EnvironmentFile") == [
        "/etc/sglang-router/sglang-router.env",
        "-/var/lib/sglang-router/workers.env",
    ]
    assert _directives(text, "User") == ["sglang-router"] and _directives(text, "CapabilityBoundingSet") == [
        ""
    ]
    assert KEY not in text  # the key is in the 0600 env file only
    env = (exposed / "sglang-router.env").read_text()
    assert f'SGLANG_ROUTER_CONTROL_KEYS="ddtree:ddtree-rotation:admin:{KEY}"' in env


@analyze
def test_the_unit_verifies_clean_and_scores_low(exposed: Path) -> None:
    unit = exposed / "sglang-router.service"
    res = subprocess.run(
        ["systemd-analyze", "verify", unit.name], cwd=exposed, capture_output=True, text=True, timeout=60
    )
    noise = [
        ln
        for ln in (res.stdout + res.stderr).splitlines()
        if ln.strip() and "/opt/sglang-router/0.3.2/bin/smg" not in ln
    ]  # the venv is not here
    assert not noise, res.stdout + res.stderr
    res = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", unit.name],
        cwd=exposed,
        capture_output=True,
        text=True,
        timeout=60,
    )
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", res.stdout)
    assert match, res.stdout[-2000:] + res.stderr
    print(f"systemd-analyze security --offline=true {unit.name}: {match.group(1)}")
    assert float(match.group(1)) <= 1.5


def test_loopback_by_default(tmp_path: Path) -> None:
    res, out = _render(tmp_path)
    assert res.returncode == 0, res.stdout[-3000:]
    text = (out / "sglang-router.service").read_text()
    assert "--host 127.0.0.1" in text and "--prometheus-host 127.0.0.1" in text
    assert "--control-plane-api-keys" not in text and _directives(text, "IPAddressAllow") == ["localhost"]


# One ansible-playbook run each (a few seconds): the cases that matter most; the argument spec refuses
# wrong types and choices (policy, install source) on its own.
@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (
            {"sglang_router_listen_address": "0.0.0.0", "sglang_router_control_key": KEY},
            "AND set sglang_router_allowed_clients to the CIDRs of the clients and scrapers",
        ),
        (
            {
                "sglang_router_listen_address": "10.0.4.9",
                "sglang_router_allowed_clients": ["any"],
                "sglang_router_control_key": KEY,
            },
            "listen on loopback, or on every address",
        ),
        (
            {"sglang_router_listen_address": "0.0.0.0", "sglang_router_allowed_clients": ["10.0.4.0/24"]},
            "a router that listens on 0.0.0.0 needs a control key",
        ),
        (
            {"sglang_router_workers": ["w1", "nosuchhost", "w1"]},
            "each once (got ['w1', 'nosuchhost', 'w1']; unknown: nosuchhost)",
        ),
        (
            {"sglang_router_extra_flags": ["--log-level info\nExecStartPre=/bin/sh"]},
            "sglang_router_extra_flags[0]: '--log-level info\\nExecStartPre=/bin/sh' holds the control",
        ),
        (
            {"sglang_router_extra_flags": ["--worker-urls http://10.9.9.9:1"]},
            "sets a flag the role's own variables set",
        ),
        (
            {
                "sglang_router_control_key": "short\nkey",
                "sglang_router_health_check_interval_s": 0,
                "sglang_router_user": "root",
            },
            "sglang_router_health_check_interval_s: 0 is out of range: 1..3600; sglang_router_user: 'root' "
            "is root: the service runs as a dedicated unprivileged account (the role creates it; the "
            "default is fine); sglang_router_control_key: (value hidden) is not 16-256 characters",
        ),
    ],
)
def test_bad_input_is_refused_before_anything_changes(tmp_path: Path, extra: dict, said: str) -> None:
    res, out = _render(tmp_path, **extra)
    assert res.returncode != 0 and said in _said(res), _said(res)[-2000:]
    assert not (out / "sglang-router.service").exists()
    assert "a-control-key" not in res.stdout  # the key never shows


def test_rotation_fallbacks_equal_the_router_defaults() -> None:
    router = yaml.safe_load((REPO / "roles/sglang_router/defaults/main.yml").read_text())
    rotation = yaml.safe_load((REPO / "roles/sglang_rotation/vars/main.yml").read_text())
    assert rotation["sglang_rotation_router_port_default"] == router["sglang_router_port"]
    assert rotation["sglang_rotation_router_metrics_port_default"] == router["sglang_router_metrics_port"]
    assert rotation["sglang_rotation_router_state_dir_default"] == router["sglang_router_state_dir"]
    makefile = (REPO / "Makefile").read_text()
    assert "roles/sglang_router/defaults/main.yml" in makefile  # make venv pins the role's release
    wheelhouse = (REPO / "requirements/lab-wheelhouse.txt").read_text()
    assert f"sglang-router=={router['sglang_router_version']}" in wheelhouse
