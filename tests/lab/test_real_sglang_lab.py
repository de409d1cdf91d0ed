"""Lab host ct131: the real SGLang 0.5.23 server on CPU with DDTREE, deployed, canaried, rolled back and
switched by the same playbooks and roles as every host (inventories/lab/host_vars/ct131.yml says what a
CPU lab host adds).

One deploy of build A for the module, then in file order: the probe report and a DDTREE /generate;
a canary of build B (live and shadow both real SGLang) that promotes; rollback.yml back to A; the
field failures (DDTREE left out of DFlash-family capture, hidden states missing, a relaxed acceptance
rule that is not lossless) failing the rollout
and rolling back to A byte-identical and serving; a profile switch. Real SGLang starts in about a
minute on a loaded CI machine, so the scenarios share every start they can. Each prints one JSON line
with its seconds.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import urllib.request
from pathlib import Path

import pytest

from tests.lab.conftest import REAL_SGLANG_HOST, REPO, LabHandle

pytestmark = pytest.mark.lab

HOST = REAL_SGLANG_HOST
UNIT = "sglang-qwen"
LIVE_FILES = ("/etc/systemd/system/sglang-qwen.service", "/etc/sglang/sglang-qwen.env")
STATE = "/var/lib/ddtree/state/sglang-qwen.json"
PROBE_REPORT = "/var/lib/ddtree/probe/sglang-qwen.json"
CPU_LAYER = Path("scripts/lab/sglang-cpu-lab")
LAB_BASE = Path("scripts/lab/sglang-lab-base")  # the machinery the CPU layer runs on (its own wheel)
# Two real servers share a loaded 2-core CI CPU during the canary: its latency gate has its own tests.
CANARY_COMMON = ["-e", "sglang_canary_rounds=2", "-e", "sglang_canary_max_latency_ratio=6"]


def report(scenario: str, **figures: object) -> None:
    print(json.dumps({"scenario": scenario, "host": HOST, **figures}))


def freeze(dest: Path, version: str | None = None) -> Path:
    """The checkout's package sources, the CPU layer and the lab base it runs on (others may edit the
    tree meanwhile)."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    shutil.copytree(REPO / "ddtree_runtime", dest / "ddtree_runtime", ignore=skip)
    for layer in (CPU_LAYER, LAB_BASE):
        shutil.copytree(REPO / layer, dest / layer, ignore=skip)
    if version is not None:
        init = dest / "ddtree_runtime" / "__init__.py"
        text = re.sub(r'^__version__ = ".*"$', f'__version__ = "{version}"', init.read_text(), flags=re.M)
        init.write_text(text)
    return dest


class Host:
    def __init__(self, lab: LabHandle) -> None:
        self.lab = lab

    def ssh(self, cmd: str, timeout: float = 120) -> str:
        proc = self.lab.ssh(HOST, cmd, timeout=timeout)
        assert proc.returncode == 0, f"{HOST}: {cmd}: {proc.stderr}"
        return proc.stdout

    def json(self, path: str) -> dict:
        return json.loads(self.ssh(f"cat {path}"))

    def play(self, playbook: str, source: Path, *extra: str) -> tuple[str, int, float]:
        started = time.monotonic()
        source_var = f"ddtree_runtime_source_dir={source}"
        proc = self.lab.ansible_playbook(playbook, "-l", HOST, "-e", source_var, *extra)
        return proc.stdout, proc.returncode, round(time.monotonic() - started, 1)

    def fingerprint(self) -> dict[str, str]:
        """Unit and env file by content; the release the unit runs by every file's name, size and mtime
        plus its small files' contents (as tests/lab/test_deploy_rollout.py does: no 2 GB hash)."""
        release = self.json(STATE)["release_dir"]
        out = self.ssh(
            f"sha256sum {' '.join(LIVE_FILES)}; cd {release} && "
            "{ find . -type f -printf '%P %s %T@\\n' | sort; "
            "sha256sum release.json pyvenv.cfg bin/*; } | sha256sum"
        )
        return {"release": release, "sums": out}

    def url(self, port: int = 30000) -> str:
        return f"http://{self.lab.addresses[HOST]}:{port}"

    def get(self, path: str, port: int = 30000) -> dict:
        with urllib.request.urlopen(self.url(port) + path, timeout=120) as resp:
            return json.loads(resp.read())

    def generate(self, text: str, tokens: int, port: int = 30000) -> dict:
        body = json.dumps({"text": text, "sampling_params": {"max_new_tokens": tokens, "temperature": 0}})
        req = urllib.request.Request(self.url(port) + "/generate", data=body.encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=300) as resp:
            return json.loads(resp.read())


def final_message(output: str) -> str:
    msgs = re.findall(r'"msg": "(Rollout of .*?)"\}', output)
    return msgs[-1] if msgs else output[-3000:]


@pytest.fixture(scope="module")
def world(lab: LabHandle, wheelhouse: Path, tmp_path_factory) -> dict:
    """Build A deployed live on ct131 (one deploy for the module); build B frozen for the canary."""
    host = Host(lab)
    a = freeze(tmp_path_factory.mktemp("real-a"))
    b = freeze(tmp_path_factory.mktemp("real-b"), "0.1.0+canary.real")
    host.lab.ssh(HOST, "systemctl disable --now sglang-qwen-shadow.service 2>/dev/null; true")
    out, rc, took = host.play("deploy.yml", a)
    assert rc == 0, out[-6000:]
    report("fresh_deploy", seconds=took)
    state = host.json(STATE)
    files = host.ssh(f"cat {' '.join(LIVE_FILES)}")
    return {"host": host, "a": a, "b": b, "release_a": state["release"], "files_a": files}


def test_the_unit_runs_real_sglang_with_the_cpu_layer_and_the_probe_passes(world):
    host: Host = world["host"]
    unit = host.ssh(f"cat {LIVE_FILES[0]}")
    assert "/bin/python -m sglang.launch_server" in unit and "ddtree tiny-engine serve" not in unit
    for flag in ("--device cpu", "--attention-backend torch_native", "--speculative-algorithm DDTREE",
                 "--speculative-ddtree-budget 16", "--max-total-tokens 8192"):  # fmt: skip
        assert flag in unit, flag
    assert "--mamba-radix-cache-strategy" not in unit  # the dense pair: the override left it out
    env = host.ssh(f"cat {LIVE_FILES[1]}")
    assert 'DDTREE_SGLANG_CPU_LAB="1"' in env and 'SGLANG_USE_CPU_ENGINE="1"' in env
    release = host.json(STATE)["release_dir"]
    extra_wheels = host.json(f"{release}/release.json")["extra_wheels"]
    assert extra_wheels == ["ddtree_sglang_lab_base-0.1.0-py3-none-any.whl",
                            "ddtree_sglang_cpu_lab-0.1.0-py3-none-any.whl"]  # fmt: skip
    probe = host.json(PROBE_REPORT)
    assert probe["ok"] is True, probe
    checked = probe["figures"]["lossless"]  # the target's own prefill agrees with every emitted token
    assert (checked["status"], checked["mismatches"]) == ("passed", 0), checked
    # every emitted token of both runs (one prompt at a time, then all at once) checked
    assert checked["tokens_checked"] == 2 * probe["figures"]["completion_tokens"] > 0
    hs = probe["handshake"]
    assert hs["status"] == "ok" and hs["expected_hidden_width"] == hs["observed_hidden_width"] == 128
    info = host.get("/server_info")
    assert info["version"] == "0.5.23" and info["speculative_algorithm"] == "DDTREE"
    assert info["ddtree_handshake"]["status"] == "ok"
    answer = host.generate("the cat sees the dog and", 64)
    meta = answer["meta_info"]
    accept = round(meta["completion_tokens"] / meta["spec_verify_ct"], 3)
    assert accept > 1.5, meta
    print("probe report:", json.dumps({k: probe[k] for k in ("ok", "message", "handshake", "figures")}))
    report("probe_and_generate", probe_message=probe["message"], completion_tokens=meta["completion_tokens"],
           verify_steps=meta["spec_verify_ct"], accept_length=accept, text=answer["text"][:80],
           probe_seconds=probe["figures"].get("probe_seconds"), lossless_seconds=checked.get("seconds"),
           lossless_tokens=checked["tokens_checked"], near_ties=checked["near_ties"])


def test_a_canary_with_live_and_shadow_both_real_sglang_promotes(world):
    host: Host = world["host"]
    out, rc, took = host.play("ansible/canary.yml", world["b"], *CANARY_COMMON)
    assert rc == 0, out[-6000:]
    result = host.json("/var/lib/ddtree/canary/last.json")
    assert result["outcome"] == "promoted" and result["tokens"]["equal"] is True, result
    assert result["live"]["release"] == world["release_a"]
    for side in ("live", "shadow"):
        assert result[side]["accept_length"] > 1.0
    assert (result["live"]["budget"], result["shadow"]["budget"]) == (16, 16)  # balanced vs shadow-small
    state = host.json(STATE)
    assert state["previous_release"] == world["release_a"] and state["release"] != world["release_a"]
    assert host.get("/server_info")["ddtree_runtime_version"] == "0.1.0+canary.real"
    assert "--device cpu" in host.ssh(f"cat {LIVE_FILES[0]}")  # the promoted unit keeps the host's flags
    print("\n".join(result["table"]))
    report("canary_promote", seconds=took, live_accept=result["live"]["accept_length"],
           shadow_accept=result["shadow"]["accept_length"])


def test_rollback_restores_build_a(world):
    host: Host = world["host"]
    out, rc, took = host.play("ansible/rollback.yml", world["a"])
    assert rc == 0, out[-6000:]
    assert host.json(STATE)["release"] == world["release_a"]
    assert host.ssh(f"cat {' '.join(LIVE_FILES)}") == world["files_a"]
    assert host.generate("the cat", 8)["text"].strip()
    report("rollback", seconds=took)


# The field failure, in SGLang's own code or the plugin's round (ddtree_sglang_cpu_lab.faults): the cause
# the rollout must name. relaxed_accept answers fluently and accepts; only the lossless check fails it.
FIELD_FAILURES = {
    "capture_predicate": ("hidden_width_mismatch", "(expected width 128, got 64)"),
    "hidden_none": ("hidden_states_missing", ""),
    "relaxed_accept": ("verify_not_lossless", "speculative verify is not lossless"),
}


@pytest.mark.parametrize("fault", list(FIELD_FAILURES))
def test_the_field_failure_fails_the_rollout_and_rolls_back_byte_identical(world, fault):
    host: Host = world["host"]
    before = host.fingerprint()
    cause, numbers = FIELD_FAILURES[fault]
    fault_env = json.dumps({"sglang_extra_env": {"DDTREE_LAB_FAULT": fault}})
    out, rc, took = host.play("deploy.yml", world["a"], "-e", fault_env)
    assert rc != 0
    message = final_message(out)
    assert cause in message and numbers in message, message
    assert "Rolled back to the previous unit, env file and release" in message, message
    assert host.fingerprint() == before, "unit/env/runtime differ after the rollback"
    assert host.ssh(f"systemctl is-active {UNIT}").strip() == "active"
    assert host.generate("the cat", 8)["text"].strip()
    print("rollout:", message)
    report(f"field_failure_{fault}", seconds=took, cause=cause)


def test_profile_switch_changes_the_flags_and_the_server_comes_back(world):
    host: Host = world["host"]
    out, rc, took = host.play("deploy.yml", world["a"], "-e", "sglang_profile=shadow-small-nograph")
    assert rc == 0, out[-6000:]
    unit = host.ssh(f"cat {LIVE_FILES[0]}")
    for flag in ("--disable-cuda-graph", "--context-length 8192", "--port 30001", "--device cpu"):
        assert flag in unit, flag
    info = host.get("/server_info", port=30001)
    assert info["context_length"] == 8192 and info["speculative_ddtree_budget"] == 16
    assert host.generate("the cat", 8, port=30001)["text"].strip()
    report("profile_switch", seconds=took)
