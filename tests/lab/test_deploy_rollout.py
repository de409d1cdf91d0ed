"""deploy.yml end to end against real lab hosts: fresh deploy, no-op rerun, --check --diff, profile
switch, and every failure the gate must stop (lab faults, mismatched drafter, port taken, unknown
profile, a host going down) with the previous service left running byte-identical. A verify that is not
lossless is rolled back on the real server (tests/lab/test_real_sglang_lab.py, relaxed_accept; the lab
engine's switch is named by the probe in tests/unit/test_probe_lab.py).

One lab for the whole module (the session's `lab` fixture), one release venv installed per host:
the package sources are frozen at the start so every run deploys the same release. Tests run in
file order and each leaves ct129 on the `balanced` profile, serving.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ddtree_runtime.ops.labhosts import nspawn as lab_nspawn

# In a parallel run, one worker runs this module with the rest of tests/conftest.py's lab-engine group, in
# file order on one lab: they share what a module deploys on ct129/ct130 (build A installs once).
pytestmark = pytest.mark.lab

HOST = "ct129"
UNIT = "sglang-qwen"
FILES = ("/etc/systemd/system/sglang-qwen.service", "/etc/sglang/sglang-qwen.env")
REPO = Path(__file__).resolve().parents[2]


def runtime_hash_cmd() -> str:
    """The release the unit runs and, in one line, a digest of every file's name, size and mtime plus the
    contents of its release.json and entry points (hashing 2 GB of contents twice per scenario cost CI
    minutes; a rollout that rewrote a file would change its size or mtime)."""
    return (
        "rel=$(grep -oE '/opt/ddtree/releases/[0-9a-f]{16}' "
        "/etc/systemd/system/sglang-qwen.service | head -1); "
        "echo $rel; cd $rel && { find . -type f -printf '%P %s %T@\\n' | sort; "
        "sha256sum release.json pyvenv.cfg bin/*; } | sha256sum"
    )


@dataclass
class Client:
    """Sends /generate to a host in a loop while a rollout runs; records (time, ok)."""

    url: str
    results: list[tuple[float, bool]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _one(self) -> bool:
        body = json.dumps({"text": "the cat", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        req = urllib.request.Request(self.url + "/generate", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status == 200
        except OSError:
            return False

    def _loop(self) -> None:
        while not self._stop.is_set():
            t = time.time()
            self.results.append((t, self._one()))
            self._stop.wait(0.2)

    def __enter__(self) -> Client:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=30)

    @property
    def failures(self) -> list[float]:
        return [t for t, ok in self.results if not ok]


class Rollout:
    def __init__(self, lab, source: Path) -> None:
        self.lab = lab
        self.source = source

    def deploy(self, *extra: str, limit: str = HOST) -> tuple[subprocess.CompletedProcess[str], float]:
        started = time.monotonic()
        proc = self.lab.ansible_playbook(
            "deploy.yml", "-l", limit, "-e", f"ddtree_runtime_source_dir={self.source}", *extra
        )
        return proc, time.monotonic() - started

    def ssh(self, cmd: str, host: str = HOST) -> str:
        proc = self.lab.ssh(host, cmd)
        assert proc.returncode == 0, f"{host}: {cmd}: {proc.stderr}"
        return proc.stdout

    def fingerprint(self, host: str = HOST) -> dict[str, str]:
        """Unit, env file and runtime, by content."""
        sums = self.ssh("sha256sum " + " ".join(FILES), host)
        runtime = self.ssh(runtime_hash_cmd(), host).split()
        return {"files": sums, "release": runtime[0], "runtime": runtime[1]}

    def main_pid_since(self, host: str = HOST) -> str:
        return self.ssh(f"systemctl show {UNIT} -p ExecMainStartTimestampMonotonic --value", host).strip()

    def url(self, host: str = HOST, port: int = 30000) -> str:
        return f"http://{self.lab.addresses[host]}:{port}"

    def generate(self, host: str = HOST, port: int = 30000) -> dict:
        body = json.dumps({"text": "the cat", "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        req = urllib.request.Request(self.url(host, port) + "/generate", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200
            return json.loads(resp.read())

    def restart_window(self, since: float) -> tuple[float, float] | None:
        """From the unit's first stop/exit after `since` to the last 'ready to roll' (host journal)."""
        out = self.ssh(f"journalctl -u {UNIT} -o short-unix --no-pager --since @{int(since)}")
        down = [float(ln.split()[0]) for ln in out.splitlines()
                if re.search(r"Stopping sglang-qwen|Main process exited|Scheduled restart|Deactivated", ln)]
        ready = [float(ln.split()[0]) for ln in out.splitlines() if "ready to roll" in ln]
        if not down:
            return None
        return min(down), max(ready) if ready else time.time()


def changed_count(output: str, host: str = HOST) -> int:
    match = re.search(rf"^{host}\s*:\s*ok=\d+\s+changed=(\d+)", output, re.M)
    assert match, output[-2000:]
    return int(match.group(1))


def final_message(output: str) -> str:
    msgs = re.findall(r'"msg": "(Rollout of .*?)"\}', output)
    return msgs[-1] if msgs else output[-3000:]


@pytest.fixture(scope="module")
def rollout(lab, wheelhouse, tmp_path_factory) -> Rollout:
    source = tmp_path_factory.mktemp("checkout")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    shutil.copytree(REPO / "ddtree_runtime", source / "ddtree_runtime",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    # A shared session lab may carry a canary's shadow unit on 30001 (the profile-switch test's port).
    for host in ("ct129", "ct130"):
        lab.ssh(host, "systemctl disable --now sglang-qwen-shadow.service 2>/dev/null; true")
    return Rollout(lab, source)


def report(name: str, **figures: object) -> None:
    print(json.dumps({"scenario": name, **figures}))


def test_fresh_deploy_serves_at_the_hosts_address(rollout):
    proc, took = rollout.deploy("-e", "serial=2", limit="ct129,ct130")
    assert proc.returncode == 0, proc.stdout[-4000:]
    for host in ("ct129", "ct130"):
        assert rollout.ssh(f"systemctl is-active {UNIT}", host).strip() == "active"
        probe = json.loads(rollout.ssh(f"cat /var/lib/ddtree/probe/{UNIT}.json", host))
        assert probe["ok"] is True and probe["handshake"]["status"] == "ok"
        checked = probe["figures"]["lossless"]  # every emitted token the target's own (hybrid ct130 too)
        assert checked["status"] == "passed"
        assert checked["tokens_checked"] == 2 * probe["figures"]["completion_tokens"]  # both runs
        state = json.loads(rollout.ssh(f"cat /var/lib/ddtree/state/{UNIT}.json", host))
        assert state["profile"] == "balanced" and state["port"] == 30000
        answer = rollout.generate(host)  # from the controller, at the host's own address
        assert answer["text"].strip()
        assert rollout.ssh(f"stat -c %a /etc/sglang/{UNIT}.env", host).strip() == "600"
        assert rollout.ssh(f"systemctl show {UNIT} -p User --value", host).strip() == "sglang"
    accept = probe["figures"].get("accept_length")
    report("fresh_deploy_2_hosts", seconds=round(took, 1), accept_length=accept)


def test_second_run_changes_nothing(rollout):
    before, pid = rollout.fingerprint(), rollout.main_pid_since()
    proc, took = rollout.deploy()
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert changed_count(proc.stdout) == 0
    assert rollout.fingerprint() == before
    assert rollout.main_pid_since() == pid  # not restarted
    report("second_run_noop", seconds=round(took, 1), changed=0)


def test_check_diff_shows_the_switch_and_changes_nothing(rollout):
    before, pid = rollout.fingerprint(), rollout.main_pid_since()
    proc, took = rollout.deploy("--check", "--diff", "-e", "sglang_profile=shadow-small")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "-    --context-length 32768" in proc.stdout
    assert "+    --context-length 8192" in proc.stdout
    # --check shows the plan: the profile against ct129's declared GPUs (two RTX A6000), term by term
    assert '"ddtree plan: profile shadow-small"' in proc.stdout and '"  verdict: FITS"' in proc.stdout
    assert rollout.fingerprint() == before
    assert rollout.main_pid_since() == pid
    report("check_diff", seconds=round(took, 1))


def test_profile_switch_changes_the_flags_and_the_service_comes_back(rollout):
    proc, took = rollout.deploy("-e", "sglang_profile=shadow-small-nograph")
    assert proc.returncode == 0, proc.stdout[-4000:]
    cmdline = rollout.ssh(f"systemctl show {UNIT} -p ExecStart --value")
    for flag in ("--disable-cuda-graph", "--context-length 8192", "--port 30001"):
        assert flag in cmdline
    info = json.loads(urllib.request.urlopen(rollout.url(port=30001) + "/server_info", timeout=30).read())
    assert info["disable_cuda_graph"] is True and info["context_length"] == 8192
    assert rollout.generate(port=30001)["text"].strip()
    back, took_back = rollout.deploy()
    assert back.returncode == 0, back.stdout[-4000:]
    assert rollout.generate()["text"].strip()
    report("profile_switch", seconds=round(took, 1), switch_back_seconds=round(took_back, 1))


# (scenario, extra vars, cause the play must name, whether the service is restarted at all)
FAILURES = [
    ("capture_predicate", {"sglang_extra_env": {"DDTREE_LAB_FAULT": "capture_predicate"}},
     "hidden_width_mismatch", True),
    ("hidden_none", {"sglang_extra_env": {"DDTREE_LAB_FAULT": "hidden_none"}}, "hidden_states_missing", True),
    ("crash_after_start", {"sglang_extra_env": {"DDTREE_LAB_FAULT": "crash_after_start"}}, "crash", True),
    ("slow_start", {"sglang_extra_env": {"DDTREE_LAB_FAULT": "slow_start", "DDTREE_LAB_START_DELAY_S": "120"},
                    "sglang_service_ready_timeout": 15}, "start_timeout", True),
    ("mem_fraction_too_small", {"sglang_extra_env": {"DDTREE_LAB_DEVICE_MEMORY_MB": "4"}},
     "mem_fraction_too_small", True),
    ("mismatched_drafter", {"sglang_draft_model_path": "/var/lib/ddtree/models/draft-mismatched"},
     "hidden_width_mismatch", False),
    ("unknown_profile", {"sglang_profile": "turbo"},
     "must be one of: balanced, balanced-tp2, shadow, shadow-small, shadow-small-nograph", False),
]


@pytest.mark.parametrize(("scenario", "extra", "cause", "restarts"), FAILURES, ids=[f[0] for f in FAILURES])
def test_failed_rollout_names_the_cause_and_keeps_the_previous(rollout, scenario, extra, cause, restarts):
    before, pid = rollout.fingerprint(), rollout.main_pid_since()
    started = time.time()
    with Client(rollout.url()) as client:
        proc, took = rollout.deploy("-e", json.dumps(extra))
        time.sleep(1)
    assert proc.returncode != 0
    message = final_message(proc.stdout) if "Rollout of" in proc.stdout else proc.stdout
    assert cause in message, message
    if scenario == "mem_fraction_too_small":  # the preflight's plan reaches the diagnosis in the rescue
        assert "Planned: KV cache" in message and "the plan expected it to fit" in message, message
        # ... and what the rescue leaves in the probe directory is no probe report to the metrics
        release = json.loads(rollout.ssh(f"cat /var/lib/ddtree/state/{UNIT}.json"))["release_dir"]
        shown = rollout.ssh(f"{release}/bin/ddtree metrics show --no-systemd")
        assert "ddtree_state_file_unreadable{" not in shown and 'unit="sglang-qwen.plan"' not in shown, shown
    assert rollout.fingerprint() == before, f"{scenario}: unit/env/runtime differ after the rollback"
    assert rollout.ssh(f"systemctl is-active {UNIT}").strip() == "active"
    assert rollout.generate()["text"].strip()
    if restarts:
        assert "Rolled back to the previous unit, env file and release" in message, message
        window = rollout.restart_window(started)
        assert window is not None, "the service was never restarted"
        lo, hi = window
        outside = [t for t in client.failures if not lo - 1.0 <= t <= hi + 1.0]
        assert outside == [], f"{len(outside)} failed requests outside the restart window {lo:.1f}..{hi:.1f}"
        report(scenario, seconds=round(took, 1), requests=len(client.results),
               failed=len(client.failures), restart_window_s=round(hi - lo, 1), cause=cause)
    else:
        assert rollout.main_pid_since() == pid, "the service was restarted"
        assert client.failures == [], f"{len(client.failures)} requests failed though nothing restarted"
        report(scenario, seconds=round(took, 1), requests=len(client.results), failed=0, cause=cause)


def test_port_already_taken(rollout):
    port = 30005
    rollout.ssh(f"systemd-run --unit=porthog -p Type=exec /usr/bin/python3 -m http.server {port} >/dev/null")
    try:
        before = rollout.fingerprint()
        started = time.time()
        with Client(rollout.url()) as client:
            proc, took = rollout.deploy("-e", f"sglang_service_port={port}")
        assert proc.returncode != 0
        message = final_message(proc.stdout)
        assert "port_in_use" in message, message
        assert rollout.fingerprint() == before
        assert rollout.generate()["text"].strip()
        window = rollout.restart_window(started)
        assert window is not None
        outside = [t for t in client.failures if not window[0] - 1.0 <= t <= window[1] + 1.0]
        assert outside == []
        report("port_in_use", seconds=round(took, 1), requests=len(client.results),
               failed=len(client.failures), restart_window_s=round(window[1] - window[0], 1))
    finally:
        rollout.lab.ssh(HOST, "systemctl stop porthog")


def test_host_down_mid_play_stops_the_rollout(rollout, lab):
    """ct129 (first batch) powers off mid-play: the play fails naming it; ct130 is never touched."""
    before, pid = rollout.fingerprint("ct130"), rollout.main_pid_since("ct130")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ANSIBLE_NOCOLOR": "1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    cmd = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(lab.inventory), "deploy.yml",
           "-l", "ct129,ct130", "-e", "serial=1", "-e", "sglang_profile=shadow",
           "-e", f"ddtree_runtime_source_dir={rollout.source}"]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: list[str] = []
    stopped = False
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if not stopped and "TASK [ddtree_probe : Run the static probe]" in line:
            (host,) = [h for h in lab.spec.hosts if h.name == "ct129"]
            lab_nspawn.stop(host)
            stopped = True
    rc = proc.wait(timeout=600)
    output = "".join(lines)
    try:
        assert stopped, output[-3000:]
        assert rc != 0
        assert re.search(r"\[ct129\]: UNREACHABLE", output), output[-3000:]
        # The next batch is refused before any change: ct130 keeps its service, byte-identical, running.
        assert "Rollout stopped before ct130 was touched: ct129 failed or became unreachable" in output
        assert rollout.fingerprint("ct130") == before
        assert rollout.main_pid_since("ct130") == pid
        assert rollout.generate("ct130")["text"].strip()
        report("host_down_mid_play", seconds=round(time.monotonic() - started, 1), other_host="untouched")
    finally:
        # Power ct129 on again (its disk kept, as after a real power cut) so later tests find the lab whole.
        up = subprocess.run([sys.executable, "-m", "ddtree_runtime", "lab", "up", "--name", lab.name,
                             "--hosts", str(len(lab.hosts))], cwd=REPO, capture_output=True, text=True)
        assert up.returncode == 0, up.stderr[-2000:]
