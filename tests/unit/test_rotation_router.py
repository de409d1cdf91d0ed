"""roles/sglang_rotation against the real sglang-router (0.3.2) and two real lab servers, all on loopback,
through the real ansible-playbook: a host leaves only once the router no longer lists it and its engine
holds no request, the last healthy worker is never taken out, a join puts the worker back, the router's
rotation file follows, a wrong control key stops the play before any change. The canary's traffic
judgement reads the same router's and engines' real metrics."""

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
from pathlib import Path

import pytest
import yaml

from ddtree_runtime.ops import canary_traffic
from tests.unit._ansible import PLAYBOOKS, REPO, tool_env
from tests.unit._router_metrics import ROUTER_METRICS
from tests.unit._tiny_engine import free_port, http, lab_models
from tests.unit._tiny_server import TinyServerProcess

# `make venv` puts the router in a venv of its own, as the role does on a router host.
SMG = Path(sys.executable).parent.parent / "router" / "bin" / "smg"
KEY = "unit-test-control-key-0123"


@pytest.fixture(scope="module", autouse=True)
def _router_installed() -> None:
    if not SMG.exists():
        why = f"{SMG} missing: `make venv` installs sglang-router there"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)


def _lab_args(models: Path, host: str) -> list[str]:
    return [
        "--model-path",
        str(models / "target"),
        "--speculative-algorithm",
        "DDTREE",
        "--speculative-draft-model-path",
        str(models / "draft"),
        "--device",
        "cpu",
        "--enable-metrics",
        "--host",
        host,
    ]


class Router:
    def __init__(self, tmp: Path, workers: list[str]) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "router.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [
                    str(SMG),
                    "launch",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--policy",
                    "round_robin",
                    "--prometheus-host",
                    "127.0.0.1",
                    "--prometheus-port",
                    str(self.metrics_port),
                    "--health-check-interval-secs",
                    "5",
                    "--control-plane-api-keys",
                    f"ddtree:ddtree-rotation:admin:{KEY}",
                    "--worker-urls",
                    *workers,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        while len(self.workers()) < len(workers):
            assert time.monotonic() < deadline and self.proc.poll() is None, self.log.read_text()[-3000:]
            time.sleep(0.1)

    def workers(self) -> dict[str, bool]:
        req = urllib.request.Request(self.url + "/workers", headers={"Authorization": f"Bearer {KEY}"})
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return {w["url"]: w["is_healthy"] for w in json.loads(resp.read())["workers"]}
        except OSError:
            return {}

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            return resp.read().decode()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """w1 on 127.0.0.1, w2 on 127.0.0.2 (two addresses, as two hosts), both behind router r1."""
    tmp = tmp_path_factory.mktemp("rotation")
    models = lab_models()
    servers = {
        name: TinyServerProcess(_lab_args(models, address), tmp=tmp)
        for name, address in (("w1", "127.0.0.1"), ("w2", "127.0.0.2"))
    }
    addresses = {"w1": "127.0.0.1", "w2": "127.0.0.2"}
    urls = {name: f"http://{addresses[name]}:{srv.port}" for name, srv in servers.items()}
    for srv in servers.values():
        srv.wait_ready(120)
    router = Router(tmp, list(urls.values()))
    state = {name: tmp / name for name in servers}
    for name, srv in servers.items():  # what sglang_service records for a deployed live unit
        state[name].mkdir()
        (state[name] / "sglang-qwen.json").write_text(json.dumps({"port": srv.port}))
    (tmp / "router-state").mkdir()
    inventory = tmp / "inventory.yml"
    common = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory.write_text(
        yaml.safe_dump(
            {
                "all": {
                    "vars": common,
                    "children": {
                        "sglang_routers": {
                            "hosts": {
                                "r1": {
                                    "ansible_host": "127.0.0.1",
                                    "sglang_router_workers": ["w1", "w2"],
                                    "sglang_router_port": router.port,
                                    "sglang_router_metrics_port": router.metrics_port,
                                    "sglang_router_control_key": KEY,
                                    "sglang_router_state_dir": str(tmp / "router-state"),
                                }
                            }
                        },
                        "gpu_hosts": {
                            "hosts": {
                                name: {
                                    "ansible_host": addresses[name],
                                    "sglang_rotation_local_address": addresses[name],
                                    "sglang_rotation_port": srv.port,
                                    "sglang_rotation_state_dir": str(state[name]),
                                    "sglang_service_host": "0.0.0.0",
                                    "sglang_service_allowed_clients": ["127.0.0.0/8"],
                                    "sglang_rotation_drain_timeout": 60,
                                }
                                for name, srv in servers.items()
                            }
                        },
                    },
                }
            }
        )
    )
    yield {"servers": servers, "urls": urls, "router": router, "inventory": inventory, "tmp": tmp}
    router.stop()
    for srv in servers.values():
        srv.stop()


def _step(fleet: dict, target: str, action: str, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        shutil.which("ansible-playbook", path=str(Path(sys.executable).parent)) or "ansible-playbook",
        "-i",
        str(fleet["inventory"]),
        str(PLAYBOOKS / "rotation.yml"),
        "-e",
        f"target={target}",
        "-e",
        f"rotation_action={action}",
        *extra,
    ]
    return subprocess.run(cmd, cwd=REPO, env=tool_env(), capture_output=True, text=True, timeout=300)


def _rotation_file(fleet: dict) -> set[str]:
    text = (fleet["tmp"] / "router-state" / "workers.env").read_text()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("SGLANG_ROUTER_WORKER_URLS=")]
    return set(line.split("=", 1)[1].split())


def test_leave_waits_for_the_request_in_flight_never_takes_the_last_worker_and_join_puts_it_back(fleet):
    router, urls, w1 = fleet["router"], fleet["urls"], fleet["servers"]["w1"]
    done: dict = {}
    # Long enough to outlast the play's steps before its drain (a few seconds), so the drain has to wait.
    body = {"text": "the cat", "sampling_params": {"temperature": 0, "max_new_tokens": 2000}}

    def long_request() -> None:
        done["status"] = http(w1.url + "/generate", body, timeout=120)[0]
        done["at"] = time.monotonic()

    before = w1.log.count("Prefill batch")
    thread = threading.Thread(target=long_request)
    thread.start()
    while w1.log.count("Prefill batch") == before:  # w1 is working on it
        time.sleep(0.01)
    leave = _step(fleet, "w1", "leave")
    left_at = time.monotonic()
    thread.join(120)
    assert leave.returncode == 0, leave.stdout[-4000:]
    assert router.workers() == {urls["w2"]: True}
    assert done["status"] == 200 and done["at"] <= left_at  # the play waited for it
    assert "w1 out of rotation; idle after" in leave.stdout, leave.stdout[-3000:]
    assert _rotation_file(fleet) == {urls["w2"]}
    try:
        refused = _step(fleet, "w2", "leave")  # w2 is all the router has left
        assert refused.returncode != 0
        out = " ".join(refused.stdout.split())
        assert (
            "last_healthy_worker: w2 is the last healthy worker of router r1 (w1 not in rotation)" in out
        ), out
        assert "Nothing was changed" in out
        assert router.workers() == {urls["w2"]: True}
    finally:
        join = _step(fleet, "w1", "join")
    assert join.returncode == 0, join.stdout[-4000:]
    assert router.workers() == {urls["w1"]: True, urls["w2"]: True}
    assert _rotation_file(fleet) == set(urls.values())
    (line,) = [
        json.loads(json.loads(m)) for m in re.findall(r'"msg": ("\{\\"rotation\\".*")\s*$', join.stdout, re.M)
    ]
    assert line["added_by"] == ["r1"] and line["out_of_rotation_s"] is None, line  # it left in another run


def test_a_wrong_control_key_stops_the_play_before_any_change(fleet):
    run = _step(fleet, "w1", "leave", "-e", "sglang_router_control_key=not-the-key-at-all-0000")
    assert run.returncode != 0
    out = " ".join(run.stdout.split())
    assert "router_unreachable: router r1 did not answer its control API for w1 (HTTP 401" in out, out
    assert KEY not in run.stdout and "not-the-key-at-all" not in run.stdout  # no key in the output
    assert fleet["router"].workers() == {url: True for url in fleet["urls"].values()}


def test_canary_traffic_judgement_reads_the_real_router_and_engines(fleet):
    router, urls, servers = fleet["router"], fleet["urls"], fleet["servers"]  # w2 answers on 127.0.0.2 only

    def snapshot() -> dict:
        return {"routers": [router.metrics()], **{n: http(urls[n] + "/metrics")[1].decode() for n in servers}}

    before = snapshot()
    for _ in range(12):
        status, _ = http(
            router.url + "/generate", {"text": "the cat", "sampling_params": {"max_new_tokens": 4}}
        )
        assert status == 200
    after = snapshot()
    report = canary_traffic.run(
        {
            "live_url": urls["w1"],
            "shadow_url": urls["w2"],
            "routers_before": before["routers"],
            "routers_after": after["routers"],
            "live_before": before["w1"],
            "live_after": after["w1"],
            "shadow_before": before["w2"],
            "shadow_after": after["w2"],
            "thresholds": {"min_requests": 5, "max_latency_ratio": 10, "latency_slack_s": 1.0},
        }
    )
    assert report["live"]["requests"] == report["shadow"]["requests"] == 6, report  # round robin
    assert report["live"]["successes"] == report["shadow"]["successes"] == 6, report
    assert report["verdict"] == "promote" and report["shadow"]["latency_mean_s"] > 0, report
    strict = canary_traffic.judge(
        canary_traffic.Side(
            **{
                k: report["live"][k]
                for k in ("url", "requests", "successes", "failures", "latency_mean_s", "latency_p50_s")
            }
        ),
        canary_traffic.Side(
            **{
                k: report["shadow"][k]
                for k in ("url", "requests", "successes", "failures", "latency_mean_s", "latency_p50_s")
            }
        ),
        canary_traffic.Thresholds(min_requests=50),
    )
    assert strict["verdict"] == "abort" and "fewer than the 50 needed" in strict["reason"]


def test_the_fleet_script_reads_the_router_with_its_key(fleet):
    """What `ddtree fleet status` runs on a router host over SSH (here locally, on stdin as there)."""
    from ddtree_runtime.ops.fleet_status import router_script

    def run(key: str) -> dict:
        proc = subprocess.run([sys.executable, "-"], input=router_script(fleet["router"].port, key),
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    assert {w["url"] for w in run(KEY)["workers"]} == set(fleet["urls"].values())
    assert run("wrong-key-0000000000") == {"error": "HTTP 401 (the control key?)"}


def test_the_router_metrics_the_rules_read_exist_and_count_retries(fleet):
    """Last in the module: w2 dies without leaving the rotation. The router retries its requests on w1
    (smg_worker_retries_total, which the lab test expects to stay 0 across rollouts), and every name the
    alert rules and the dashboard use is in its real /metrics."""
    router, servers = fleet["router"], fleet["servers"]
    servers["w2"].proc.kill()
    servers["w2"].proc.wait(10)
    for _ in range(4):
        assert (
            http(router.url + "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2}})[0] == 200
        )
    text = router.metrics()
    present = {
        line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")
    }
    assert present >= ROUTER_METRICS, ROUTER_METRICS - present
    retries = sum(float(v) for v in re.findall(r"(?m)^smg_worker_retries_total\{[^}]*\} (\S+)$", text))
    assert retries >= 1, text
