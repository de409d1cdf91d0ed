"""The rendered sglang-qwen unit and env file, for every profile, through the role's real templates.

Rendering runs the real ansible-playbook on localhost (tests/unit/playbooks/render_units.yml: the
role's preflight picks the profile, its templates render); the checks then read the files.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.unit._ansible import PLAYBOOKS, REPO, playbook

PROFILES_FILE = REPO / "roles/sglang_service/vars/profiles.yml"
PROFILES = yaml.safe_load(PROFILES_FILE.read_text())["sglang_service_profiles"]
SECRET = "hf_not_a_real_token_42"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("units")
    release = out / "release"
    (release / "bin").mkdir(parents=True)
    # systemd-analyze verify checks that ExecStart's binary exists and is executable.
    (release / "bin/python").symlink_to(shutil.which("python3") or "/usr/bin/python3")
    for name in PROFILES:
        (out / name).mkdir()
    extra = json.dumps({"sglang_secret_env": {"HF_TOKEN": SECRET},
                        "sglang_extra_env": {"DDTREE_LAB_FAULT": "hidden_none"}})
    result = playbook(
        PLAYBOOKS / "render_units.yml",
        "-e", f"out_dir={out}",
        "-e", f"sglang_service_release_dir={release}",
        "-e", f"sglang_service_unit_template={REPO}/templates/sglang-qwen.service.j2",
        "-e", f"sglang_service_env_template={REPO}/templates/sglang-qwen.env.j2",
        "-e", extra,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    return out


def unit_text(rendered: Path, profile: str) -> str:
    return (rendered / profile / "sglang-qwen.service").read_text()


def sections(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    current = ""
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = line.strip("[]")
            out[current] = []
        else:
            out[current].append(line)
    return out


def directive(text: str, name: str) -> list[str]:
    lines = [line for sec in sections(text).values() for line in sec]
    return [line.split("=", 1)[1] for line in lines if line.startswith(name + "=")]


def exec_args(text: str) -> list[str]:
    (cmd,) = directive(text, "ExecStart")
    return shlex.split(cmd)


def flag_values(argv: list[str]) -> dict[str, str | bool]:
    out: dict[str, str | bool] = {}
    i = 0
    while i < len(argv):
        if argv[i].startswith("--"):
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                out[argv[i][2:]] = argv[i + 1]
                i += 2
                continue
            out[argv[i][2:]] = True
        i += 1
    return out


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_exec_start_carries_the_profiles_flags_and_port(rendered, profile):
    argv = exec_args(unit_text(rendered, profile))
    assert argv[:3] == [str(rendered / "release/bin/python"), "-m", "sglang.launch_server"]
    flags = flag_values(argv[3:])
    for name, value in PROFILES[profile]["flags"].items():
        if value is True:
            assert flags[name] is True, name
        else:
            assert flags[name] == str(value), name
    assert flags["port"] == str(PROFILES[profile]["port"])
    assert flags["speculative-algorithm"] == "DDTREE"
    assert flags["model-path"] == "/var/lib/ddtree/models/target"
    assert flags["speculative-draft-model-path"] == "/var/lib/ddtree/models/draft"


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_flags_use_the_pinned_spelling(rendered, profile):
    flags = flag_values(exec_args(unit_text(rendered, profile))[3:])
    # Removed in SGLang 0.5.20+: the server refuses to start with them.
    assert not {"cuda-graph-max-bs", "cuda-graph-bs", "mamba-scheduler-strategy"} & set(flags)
    # The lab engine's parser carries the pinned release's flag set: every rendered flag parses.
    server_args = pytest.importorskip("ddtree_runtime.tiny_engine.server_args")
    parser = argparse.ArgumentParser(exit_on_error=False)
    server_args.add_server_args(parser)
    parsed = parser.parse_args(exec_args(unit_text(rendered, profile))[3:])
    assert parsed.port == PROFILES[profile]["port"]


def test_profiles_cover_the_names_and_the_memory_knobs():
    assert set(PROFILES) == {"balanced", "balanced-tp2", "shadow", "shadow-small", "shadow-small-nograph"}
    for name, profile in PROFILES.items():
        flags = profile["flags"]
        for knob in ("tp-size", "mem-fraction-static", "context-length", "max-running-requests",
                     "mamba-radix-cache-strategy", "mamba-ssm-dtype", "max-mamba-cache-size",
                     "speculative-ddtree-budget"):
            assert knob in flags, (name, knob)
        assert ("cuda-graph-max-bs-decode" in flags) != bool(flags.get("disable-cuda-graph")), name
    assert PROFILES["shadow-small-nograph"]["flags"]["disable-cuda-graph"] is True
    assert PROFILES["balanced"]["port"] == PROFILES["balanced-tp2"]["port"] == 30000
    assert {PROFILES[p]["port"] for p in ("shadow", "shadow-small", "shadow-small-nograph")} == {30001}


def test_unit_shape_for_a_gpu_inference_server(rendered):
    text = unit_text(rendered, "balanced")
    secs = sections(text)
    unit_keys = {line.split("=", 1)[0] for line in secs["Unit"]}
    service_keys = {line.split("=", 1)[0] for line in secs["Service"]}
    assert {"StartLimitIntervalSec", "StartLimitBurst"} <= unit_keys
    assert not {"StartLimitIntervalSec", "StartLimitBurst", "StartLimitInterval"} & service_keys
    assert directive(text, "Type") == ["exec"]
    assert directive(text, "User") == ["sglang"]
    assert directive(text, "Restart") == ["on-failure"]
    assert directive(text, "SuccessExitStatus") == ["SIGKILL"]
    assert directive(text, "RestartForceExitStatus") == ["SIGKILL"]  # a self-kill outside a stop = crash
    assert directive(text, "KillMode") == ["control-group"]
    assert int(directive(text, "TimeoutStartSec")[0]) >= 1800
    assert directive(text, "EnvironmentFile") == ["/etc/sglang/sglang-qwen.env"]
    # GPU devices reachable: no PrivateDevices, an explicit allow list under a closed policy.
    assert "PrivateDevices" not in service_keys
    assert "MemoryDenyWriteExecute" not in service_keys  # breaks Triton/PyTorch JIT
    assert directive(text, "DevicePolicy") == ["closed"]
    assert "char-nvidia rwm" in directive(text, "DeviceAllow")
    assert "char-nvidia-uvm rwm" in directive(text, "DeviceAllow")


def test_secrets_only_in_the_0600_env_file(rendered):
    for profile in PROFILES:
        unit = unit_text(rendered, profile)
        env = rendered / profile / "sglang-qwen.env"
        assert SECRET not in unit
        assert f'HF_TOKEN="{SECRET}"' in env.read_text()
        assert 'DDTREE_LAB_FAULT="hidden_none"' in env.read_text()
        assert env.stat().st_mode & 0o777 == 0o600


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_systemd_analyze_verify_is_clean(rendered, profile):
    unit = rendered / profile / "sglang-qwen.service"
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    # Unknown keys or misplaced directives are only warnings (rc 0): the output must be empty too.
    assert result.returncode == 0, result.stderr
    lines = [ln for ln in (result.stdout + result.stderr).splitlines() if ln.strip()]
    assert lines == []


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_security_exposure(rendered):
    unit = rendered / "balanced" / "sglang-qwen.service"
    result = subprocess.run(["systemd-analyze", "security", "--offline=true", str(unit)],
                            capture_output=True, text=True)
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+) (\w+)", result.stdout)
    assert match, result.stdout[-2000:] + result.stderr
    exposure = float(match.group(1))
    print(f"systemd-analyze security --offline=true sglang-qwen.service: {exposure} {match.group(2)}")
    # 10 = no sandboxing at all; only the GPU device access and the network listener remain.
    assert exposure <= 2.5


def test_lab_can_drop_sandbox_directives(tmp_path):
    out = tmp_path / "out"
    for name in PROFILES:
        (out / name).mkdir(parents=True)
    result = playbook(
        PLAYBOOKS / "render_units.yml",
        "-e", f"out_dir={out}",
        "-e", "sglang_service_release_dir=/opt/ddtree/releases/x",
        "-e", "sglang_service_engine=lab",
        "-e", f"sglang_service_unit_template={REPO}/templates/sglang-qwen.service.j2",
        "-e", f"sglang_service_env_template={REPO}/templates/sglang-qwen.env.j2",
        "-e", '{"sglang_service_sandbox_disable": ["DevicePolicy", "ProtectClock"]}',
    )
    assert result.returncode == 0, result.stdout[-3000:]
    text = (out / "balanced" / "sglang-qwen.service").read_text()
    assert "DevicePolicy" not in text and "DeviceAllow" not in text and "ProtectClock" not in text
    assert "ProtectSystem=strict" in text
    assert exec_args(text)[:3] == ["/opt/ddtree/releases/x/bin/ddtree", "tiny-engine", "serve"]
