"""ansible/canary.yml and ansible/rollback.yml end to end on the lab hosts (real systemd, sshd, ansible).

Build A (this checkout) is deployed live on ct129 and ct130 once; build B is a copy with another
version string, so its release id differs. In order: B carrying each lab fault aborts on ct129
(shadow removed, live untouched byte for byte and not restarted) and ct130 is never touched; the
good B promotes on ct129, then ct130; rollback.yml puts A back on ct129. The deployed state is
shared between the scenarios (CI time).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.lab.conftest import REPO, LabHandle

# In a parallel run, one worker runs this module with the rest of tests/conftest.py's lab-engine group, in
# file order on one lab: they share what a module deploys on ct129/ct130 (build A installs once).
pytestmark = pytest.mark.lab

CANARY, ROLLBACK = "ansible/canary.yml", "ansible/rollback.yml"
LIVE_FILES = (
    "/etc/systemd/system/sglang-qwen.service",
    "/etc/sglang/sglang-qwen.env",
    "/var/lib/ddtree/state/sglang-qwen.json",
)
# The comparison's latency check has its own tests; two lab servers share a loaded CI CPU here. Both sides
# run budget 16 (shadow-small runs what live runs), but the two builds' accept lengths are what the trained
# tiny pair happens to give: the floor here is what is certain (a step emits 1 to 17 tokens);
# tests/unit/test_canary.py holds the ratio's arithmetic on a pair made to agree.
COMMON = ["-e", "sglang_canary_rounds=2", "-e", "sglang_canary_max_latency_ratio=4",
          "-e", "sglang_canary_min_accept_ratio=0.05"]


def _json(lab: LabHandle, host: str, path: str) -> dict | None:
    proc = lab.ssh(host, f"cat {path}")
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def fingerprint(lab: LabHandle, host: str) -> dict[str, str]:
    """Live's unit, env file, state and release (every file's size and mtime) and its main process."""
    release = (_json(lab, host, LIVE_FILES[2]) or {}).get("release_dir", "/nonexistent")
    script = (
        f"sha256sum {' '.join(LIVE_FILES)} {release}/release.json; "
        f"find {release} -type f -printf '%P %s %T@\\n' | sort | sha256sum; "
        "systemctl show sglang-qwen.service -p MainPID -p ExecMainStartTimestamp -p NRestarts -p ActiveState"
    )
    proc = lab.ssh(host, script)
    assert proc.returncode == 0, proc.stderr
    return {"release": release, "lines": proc.stdout}


def _exists(lab: LabHandle, host: str, path: str) -> bool:
    return lab.ssh(host, f"test -e {path}").returncode == 0


def _release_of(lab: LabHandle, host: str) -> str:
    return _json(lab, host, LIVE_FILES[2])["release"]


def _runtime_version(lab: LabHandle, host: str, port: int = 30000) -> str:
    url = f"http://127.0.0.1:{port}/server_info"
    proc = lab.ssh(
        host,
        f"python3 -c \"import json,urllib.request;print(json.load(urllib.request.urlopen('{url}'))"
        "['ddtree_runtime_version'])\"",
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def _build_id(source: Path) -> str:
    """The release id the runtime role will give this checkout (its build, as the role runs it, the lab's
    pins)."""
    group = yaml.safe_load((REPO / "inventories/lab/group_vars/all.yml").read_text())
    pins = group["ddtree_runtime_packages"] + group["ddtree_runtime_nodeps_packages"]
    argv = [sys.executable, "-m", "ddtree_runtime.ops.build_release", "--source", str(source),
            "--out", str(REPO / ".whl")]  # fmt: skip
    proc = subprocess.run([*argv, *[f"--pin={p}" for p in pins]], cwd=REPO, capture_output=True, text=True,
                          timeout=600, check=True)  # fmt: skip
    return json.loads(proc.stdout)["release_id"]


def _freeze(dest: Path, version: str | None = None) -> tuple[Path, str]:
    """A copy of the checkout's package sources (others may edit the tree meanwhile), version changed."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    shutil.copytree(REPO / "ddtree_runtime", dest / "ddtree_runtime",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))  # fmt: skip
    init = dest / "ddtree_runtime" / "__init__.py"
    lines = init.read_text().splitlines()
    (current,) = [line.split('"')[1] for line in lines if line.startswith("__version__ = ")]
    if version is not None:
        lines = [
            f'__version__ = "{version}"' if line.startswith("__version__ = ") else line for line in lines
        ]
        init.write_text("\n".join(lines) + "\n")
    return dest, version or current


@pytest.fixture(scope="module")
def world(lab: LabHandle, wheelhouse: Path, tmp_path_factory) -> dict:
    """Build A live on both hosts, build B ready to canary; nothing of B or of a canary on the hosts."""
    a, version_a = _freeze(tmp_path_factory.mktemp("build-a"))
    b, version_b = _freeze(tmp_path_factory.mktemp("build-b"), version_a + "+canary.b")
    deploy = lab.ansible_playbook(
        "deploy.yml", "-l", ",".join(lab.lab_engine_hosts), "-e", f"ddtree_runtime_source_dir={a}"
    )
    assert deploy.returncode == 0, deploy.stdout[-5000:]
    ids = {"a": _release_of(lab, lab.lab_engine_hosts[0]), "b": _build_id(b)}
    assert ids["a"] != ids["b"]
    for host in lab.lab_engine_hosts:
        assert _release_of(lab, host) == ids["a"]
        # A leftover of an earlier session on a kept lab would blur "never touched".
        lab.ssh(host, f"rm -rf /opt/ddtree/releases/{ids['b']} /var/lib/ddtree/canary")
    before = {
        host: {p: lab.ssh(host, f"cat {p}").stdout for p in LIVE_FILES[:2]} for host in lab.lab_engine_hosts
    }
    return {"b": b, "ids": ids, "version": version_b, "version_a": version_a, "unit_a": before}


def _canary(lab: LabHandle, world: dict, *extra: str):
    return lab.ansible_playbook(
        CANARY, "-l", ",".join(lab.lab_engine_hosts), "-e", f"ddtree_runtime_source_dir={world['b']}",
        *COMMON, *extra,
    )


FAULTS = {
    "capture_predicate": (
        {"canary_shadow_extra_env": {"DDTREE_LAB_FAULT": "capture_predicate"}},
        "hidden_width_mismatch",
    ),
    "hidden_none": (
        {"canary_shadow_extra_env": {"DDTREE_LAB_FAULT": "hidden_none"}},
        "hidden_states_missing",
    ),
    "crash_after_start": (
        {
            "canary_shadow_extra_env": {
                "DDTREE_LAB_FAULT": "crash_after_start",
                "DDTREE_LAB_CRASH_AFTER_S": "2",
            }
        },
        "",
    ),
    "mem_fraction": (
        {"canary_shadow_extra_flags": ["--mem-fraction-static", "0.02"]},
        "mem_fraction_too_small",
    ),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_faulty_build_aborts_on_the_canary_host_and_the_second_is_never_touched(lab, world, fault):
    canary_host, second = lab.lab_engine_hosts
    before = {host: fingerprint(lab, host) for host in lab.lab_engine_hosts}
    extra, cause = FAULTS[fault]
    run = _canary(lab, world, "-e", json.dumps(extra))
    out = run.stdout
    assert run.returncode != 0, out[-4000:]
    assert f"Canary of release {world['ids']['b']} on {canary_host}" in out and "aborted at stage" in out
    assert cause in out, out[-4000:]
    if fault == "mem_fraction":  # the shadow's plan reaches the diagnosis
        assert "Planned: KV cache" in out, out[-4000:]
    assert "live untouched" in out
    # ct130 never got past the preflight: the second serial batch did not start.
    batches = out.split("PLAY [Canary the new build beside live")[1:]
    assert len(batches) == 1 and f"[{second}]" not in batches[0]
    for host in lab.lab_engine_hosts:
        assert fingerprint(lab, host) == before[host], f"live changed on {host}"
        assert not _exists(lab, host, "/etc/systemd/system/sglang-qwen-shadow.service")
        assert not _exists(lab, host, "/etc/sglang/sglang-qwen-shadow.env")
        assert not _exists(lab, host, "/var/lib/ddtree/state/sglang-qwen-shadow.json")
    assert lab.ssh(canary_host, "systemctl is-active sglang-qwen-shadow.service").stdout.strip() in (
        "inactive",
        "unknown",
    )
    assert not _exists(lab, second, f"/opt/ddtree/releases/{world['ids']['b']}")
    assert not _exists(lab, second, "/var/lib/ddtree/canary")
    report = _json(lab, canary_host, "/var/lib/ddtree/canary/last.json")
    assert (
        report["outcome"] == "aborted" and report["verdict"] == "abort" and report["live_untouched"] is True
    )
    assert report["stage"] in ("shadow_start", "shadow_probe", "compare") and cause in report["message"]


def test_the_shadow_profile_must_be_a_shadow_one_checked_before_any_change(lab, world):
    before = {host: fingerprint(lab, host) for host in lab.lab_engine_hosts}
    run = _canary(lab, world, "-e", "canary_shadow_profile=balanced")
    assert run.returncode != 0
    # The role's argument spec refuses it first (its preflight assert says the same).
    valid = "shadow, shadow-small, shadow-small-nograph"
    assert f"sglang_canary_shadow_profile must be one of: {valid}, got: balanced" in run.stdout
    assert "Canary the new build beside live" not in run.stdout
    assert {host: fingerprint(lab, host) for host in lab.lab_engine_hosts} == before


def test_a_good_build_promotes_on_the_canary_host_then_the_second(lab, world):
    run = _canary(lab, world)
    out = run.stdout
    assert run.returncode == 0, out[-6000:]
    first, second = lab.lab_engine_hosts
    # serial [1, "100%"]: two batches, the canary host alone (its whole canary), then the rest.
    batches = out.split("PLAY [Canary the new build beside live")[1:]
    assert len(batches) == 2, out[-3000:]
    assert f"[{first}]" in batches[0] and f"[{second}]" not in batches[0]
    assert "Record the promotion" in batches[0] and "canary PROMOTE" in batches[0]
    tasks_second = batches[1].split("PLAY RECAP")[0]
    assert f"[{second}]" in tasks_second and f"[{first}]" not in tasks_second
    assert out.count("canary PROMOTE") == 2
    for host in lab.lab_engine_hosts:
        state = _json(lab, host, LIVE_FILES[2])
        assert (state["release"], state["previous_release"]) == (world["ids"]["b"], world["ids"]["a"])
        assert state["profile"] == "balanced"
        assert _runtime_version(lab, host) == world["version"]
        assert not _exists(lab, host, "/etc/systemd/system/sglang-qwen-shadow.service")
        assert lab.ssh(host, "systemctl is-active sglang-qwen-shadow.service").stdout.strip() in (
            "inactive",
            "unknown",
        )
        report = _json(lab, host, "/var/lib/ddtree/canary/last.json")
        assert report["outcome"] == "promoted" and report["verdict"] == "promote"
        assert (
            report["live"]["release"] == world["ids"]["a"]
            and report["shadow"]["release"] == world["ids"]["b"]
        )
        assert report["tokens"]["equal"] is True
        for side in ("live", "shadow"):
            assert report[side]["accept_length"] > 1.0 and report[side]["latency_median_s"] > 0
        assert report["shadow"]["budget"] == report["live"]["budget"] == 16  # shadow-small runs live's
        print(f"\n{host} canary report:\n" + "\n".join(report["table"]))


def test_rollback_restores_the_previous_build(lab, world):
    host, other = lab.lab_engine_hosts
    other_before = fingerprint(lab, other)
    run = lab.ansible_playbook(ROLLBACK, "-l", host)
    assert run.returncode == 0, run.stdout[-5000:]
    state = _json(lab, host, LIVE_FILES[2])
    assert (state["release"], state["previous_release"]) == (world["ids"]["a"], world["ids"]["b"])
    for path in LIVE_FILES[:2]:  # the very unit and env file build A ran with
        assert lab.ssh(host, f"cat {path}").stdout == world["unit_a"][host][path]
    assert _runtime_version(lab, host) == world["version_a"]
    assert lab.ssh(host, "systemctl is-active sglang-qwen.service").stdout.strip() == "active"
    assert fingerprint(lab, other) == other_before
