"""The lab's SGLang-on-CPU layer (scripts/lab/sglang-cpu-lab/) never reaches a production release.

A production release is what the runtime role builds without ``ddtree_runtime_lab_cpu_compat``: the
ddtree-runtime wheel alone. The layer is a distribution of its own, only a lab inventory turns it on,
the role refuses it on a host outside a lab, and nothing in ddtree_runtime refers to it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.unit._ansible import BIN, PLAYBOOKS, REPO, playbook, tool_env

# The runtime role runs it as `python -m` in the controller environment (the checkout first on the path).
BUILD = ["-m", "ddtree_runtime.ops.build_release"]
LAYER = REPO / "scripts/lab/sglang-cpu-lab"
# The GPU lab's layer (scripts/lab/sglang-gpu-lab/) is lab-only too: only scripts/lab/gpu/device.sh
# installs it.
MARKERS = ("ddtree_sglang_cpu_lab", "ddtree_sglang_gpu_lab", "ddtree_sglang_lab_base", "sgl_kernel", ".pth")
BASE = REPO / "scripts/lab/sglang-lab-base"


def build(out: Path, *extra: str) -> dict:
    cmd = [sys.executable, *BUILD, "--source", str(REPO), "--out", str(out), "--pin=sglang==0.5.23"]
    cmd += extra
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def names(wheel: str) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_a_production_release_holds_none_of_the_layer_and_a_lab_one_is_another_release(tmp_path):
    production = build(tmp_path / "prod")
    assert production["extra_wheels"] == []
    files = names(production["wheel"])
    assert any(f.startswith("ddtree_runtime/sglang_plugin/") for f in files)
    assert [f for f in files if any(m in f for m in MARKERS)] == []

    # As the role builds a lab CPU host's release: the layers' base, then the layer.
    lab = build(tmp_path / "lab", f"--extra-project={BASE}", f"--extra-project={LAYER}")
    base, layer = lab["extra_wheels"]
    assert "ddtree_sglang_cpu_lab.pth" in names(layer["wheel"])
    # The boot runs the layers' base, its own wheel in the same release: without it the layer cannot start.
    assert "ddtree_sglang_lab_base/layer.py" in names(base["wheel"])
    assert not any(n.startswith("ddtree_sglang_lab_base/") for n in names(layer["wheel"]))
    assert lab["wheel_sha256"] == production["wheel_sha256"]  # the same ddtree-runtime wheel ...
    assert lab["release_id"] != production["release_id"]  # ... in a release named apart


def test_ddtree_runtime_and_the_roles_never_refer_to_the_lab_layers():
    layers = ("ddtree_sglang_cpu_lab", "ddtree_sglang_gpu_lab", "ddtree_sglang_lab_base")
    hits = [str(p.relative_to(REPO)) for p in (REPO / "ddtree_runtime").rglob("*.py")
            if any(layer in p.read_text() for layer in layers)]  # fmt: skip
    assert hits == []
    roles = [str(p.relative_to(REPO)) for p in (REPO / "roles").rglob("*") if p.is_file()
             and "sglang-gpu-lab" in p.read_text(errors="replace")]  # fmt: skip
    assert roles == []  # no role builds or installs the GPU lab's layer


def test_no_production_host_turns_the_layer_on():
    cmd = [str(BIN / "ansible-inventory"), "-i", str(REPO / "inventories/production"), "--list"]
    inventory = json.loads(subprocess.run(cmd, cwd=REPO, env=tool_env(), capture_output=True, text=True,
                                          timeout=120, check=True).stdout)  # fmt: skip
    hostvars = inventory["_meta"]["hostvars"]
    assert hostvars, "the production inventory lists no hosts?"
    for host, hv in hostvars.items():
        assert not hv.get("ddtree_runtime_lab_cpu_compat", False), host
        env = {**hv.get("sglang_service_engine_env", {}), **hv.get("sglang_extra_env", {})}
        assert "DDTREE_SGLANG_CPU_LAB" not in env, host
        assert hv.get("sglang_service_engine", "sglang") == "sglang", host


def test_the_role_refuses_the_layer_on_a_host_outside_a_lab():
    result = playbook(PLAYBOOKS / "preflight.yml", "-e", f"ddtree_runtime_source_dir={REPO}",
                      "-e", "ddtree_runtime_lab_cpu_compat=true")  # fmt: skip
    assert result.returncode != 0
    assert "is a lab-only layer" in " ".join(result.stdout.split()), result.stdout[-3000:]
