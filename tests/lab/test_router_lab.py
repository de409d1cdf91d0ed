"""The real sglang-router (0.3.2, on ct131) in front of the lab-engine hosts ct129 and ct130: no failed
client request across a two-host rolling deploy, a profile switch, a canary promotion (with a share of
real traffic for the shadow) and a rollback. During the rolling deploy a second client sends the same
requests straight to ct129, as clients did before the router: its failures are what the router spares.

Traffic is bounded (a few threads, a fixed cap of requests and seconds) and goes to the lab's own
addresses only. Each scenario prints one JSON line: requests, failures, p50 / p99 latency, the router's
retries (0: no request ever reached a restarting host) and how long each host was out of rotation. The
lab's router inventory (inventories/lab-router) is a second inventory source beside the lab's own;
without it the other lab tests deploy as before. The rollback goes to the release the state records as
previous: the same build here (a second build would cost two venv installs), so it restarts ct129 with
the inventory's environment instead of the canary's.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from tests.lab._traffic import RotationWatch, Traffic
from tests.lab.conftest import REPO, LabHandle

pytestmark = pytest.mark.lab

ROUTER_INVENTORY = REPO / "inventories" / "lab-router"
ROUTER_VARS = yaml.safe_load((ROUTER_INVENTORY / "group_vars" / "sglang_routers.yml").read_text())
ROUTER, WORKERS = "ct131", ("ct129", "ct130")
# Restarts are what is measured, not start-up stability (tests/lab/test_deploy_rollout.py holds that).
FAST = ["-e", "sglang_service_stable_s=2"]


def _play(lab: LabHandle, playbook: str, *args: str):
    return lab.ansible_playbook("-i", str(ROUTER_INVENTORY), playbook, *FAST, *args)


RUN = uuid.uuid4().hex[:8]  # each run's environment differs from whatever the hosts run: a real change


def _env(value: str) -> list[str]:
    return ["-e", json.dumps({"sglang_extra_env": {"DDTREE_ROUTER_LAB": f"{value}-{RUN}"}})]


def _state(lab: LabHandle, host: str) -> dict:
    proc = lab.ssh(host, "cat /var/lib/ddtree/state/sglang-qwen.json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _retries(router_metrics: str) -> float:
    return sum(float(v) for v in re.findall(r"(?m)^smg_worker_retries_total\{[^}]*\} (\S+)$", router_metrics))


class Fleet:
    def __init__(self, lab: LabHandle) -> None:
        self.lab = lab
        address = lab.addresses[ROUTER]
        self.router = f"http://{address}:{ROUTER_VARS.get('sglang_router_port', 30080)}"
        self.metrics = f"http://{address}:{ROUTER_VARS.get('sglang_router_metrics_port', 29000)}/metrics"
        self.key = ROUTER_VARS["sglang_router_control_key"]

    def url(self, host: str, port: int = 30000) -> str:
        return f"http://{self.lab.addresses[host]}:{port}"

    def watch(self) -> RotationWatch:
        return RotationWatch(self.router, self.key)

    def router_metrics(self) -> str:
        with urllib.request.urlopen(self.metrics, timeout=10) as resp:
            return resp.read().decode()

    def serving(self) -> set[str]:
        return set(self.watch().serving())

    def measure(self, name: str, playbook: str, *args: str, direct_to: str | None = None) -> dict:
        """Run the play with traffic through the router (and straight to one host); one JSON line."""
        retries_before = _retries(self.router_metrics())
        started = time.monotonic()
        direct = Traffic(self.url(direct_to), threads=1) if direct_to else None
        with self.watch() as watch, Traffic(self.router) as routed:
            if direct:
                direct.__enter__()
            try:
                run = _play(self.lab, playbook, *args)
            finally:
                if direct:
                    direct.__exit__(None, None, None)
        assert run.returncode == 0, run.stdout[-6000:]
        plays = [
            json.loads(json.loads(m))
            for m in re.findall(r'"msg": ("\{\\"rotation\\".*")\s*$', run.stdout, re.M)
        ]
        line = {
            "scenario": name,
            "play_s": round(time.monotonic() - started, 1),
            "through_router": routed.figures(),
            "router_retries": _retries(self.router_metrics()) - retries_before,
            "out_of_rotation_s": {h: watch.out_of_rotation_s(self.lab.addresses[h]) for h in WORKERS},
            "out_of_rotation_s_by_play": {p["host"]: p["out_of_rotation_s"] for p in plays},
            "min_workers_serving": watch.min_serving(),
        }
        if direct:
            line["straight_to_" + direct_to] = direct.figures()
        print(json.dumps(line))
        return line


DEPLOYED = "systemctl is-active sglang-qwen && test -s /var/lib/ddtree/state/sglang-qwen.json"


@pytest.fixture(scope="module")
def fleet(lab: LabHandle, wheelhouse: Path) -> Fleet:
    """The router on ct131; ct129 and ct130 serving and in its rotation. Hosts an earlier test deployed
    only join (probed first, no restart); a fresh lab's, or ones that do not serve well, are deployed."""
    router = _play(lab, "ansible/router.yml")
    assert router.returncode == 0, router.stdout[-4000:]
    limit = ["-l", ",".join(WORKERS)]
    base = None
    if all(lab.ssh(h, DEPLOYED).returncode == 0 for h in WORKERS):
        base = _play(lab, "ansible/rotation.yml", *limit, "-e", "rotation=join")
    if base is None or base.returncode != 0:
        base = _play(lab, "deploy.yml", *limit)
    assert base.returncode == 0, base.stdout[-6000:]
    fleet = Fleet(lab)
    assert fleet.serving() == {fleet.url(h, _state(lab, h)["port"]) for h in WORKERS}
    return fleet


def _no_failure(line: dict) -> None:
    routed = line["through_router"]
    assert routed["requests"] > 50, line
    assert routed["failures"] == 0, line
    assert line["router_retries"] == 0, line  # no request was ever sent to a host on its way down
    assert line["min_workers_serving"] >= 1, line


def test_rolling_deploy_through_the_router_fails_no_request_and_straight_to_a_host_some(fleet: Fleet):
    hosts = ",".join(WORKERS)
    line = fleet.measure("rolling deploy ct129,ct130", "deploy.yml", "-l", hosts, *_env("round-1"),
                         direct_to="ct129")  # fmt: skip
    _no_failure(line)
    assert all(line["out_of_rotation_s"][h] > 0 for h in WORKERS), line  # both restarted, one at a time
    assert line["min_workers_serving"] == 1, line
    straight = line["straight_to_ct129"]
    assert straight["requests"] > 20 and straight["failures"] > 0, line  # what the router prevents
    assert fleet.serving() == {fleet.url(h) for h in WORKERS}  # both on balanced, port 30000


def test_profile_switch_moves_the_worker_to_its_new_port(fleet: Fleet):
    line = fleet.measure("profile switch ct130 balanced -> shadow-small", "deploy.yml", "-l", "ct130",
                         "-e", "sglang_profile=shadow-small", *_env("round-1"))  # fmt: skip
    _no_failure(line)
    assert line["out_of_rotation_s"]["ct130"] > 0 and line["out_of_rotation_s"]["ct129"] == 0, line
    assert _state(fleet.lab, "ct130")["port"] == 30001
    assert fleet.serving() == {fleet.url("ct129"), fleet.url("ct130", 30001)}


def test_canary_promotion_gives_the_shadow_real_traffic_then_promotes(fleet: Fleet):
    # Two lab servers share a loaded CI CPU: the latency check has its own tests (test_canary_lab.py).
    # The acceptance ratio of a smaller shadow budget on the trained tiny pair is luck: the certain floor
    # (tests/lab/test_canary_lab.py says why).
    thresholds = ["-e", "sglang_canary_rounds=2", "-e", "sglang_canary_max_latency_ratio=4",
                  "-e", "sglang_canary_min_accept_ratio=0.05",
                  "-e", "sglang_canary_traffic_requests=10", "-e", "sglang_canary_traffic_s=60"]  # fmt: skip
    line = fleet.measure("canary + promotion ct129", "ansible/canary.yml", "-l", "ct129", *_env("canary"),
                         *thresholds)  # fmt: skip
    _no_failure(line)
    report = json.loads(fleet.lab.ssh("ct129", "cat /var/lib/ddtree/canary/last.json").stdout)
    assert report["outcome"] == "promoted", report
    traffic = report["traffic"]
    assert traffic["verdict"] == "promote" and traffic["shadow"]["requests"] >= 10, traffic
    assert traffic["shadow"]["failures"] == 0 and traffic["live"]["requests"] > 0, traffic
    print("\n".join(traffic["table"]))
    assert fleet.serving() == {fleet.url("ct129"), fleet.url("ct130", 30001)}  # the shadow left again


def test_rollback_goes_through_the_router(fleet: Fleet):
    line = fleet.measure("rollback ct129", "ansible/rollback.yml", "-l", "ct129")
    _no_failure(line)
    assert line["out_of_rotation_s"]["ct129"] > 0, line
    assert fleet.serving() == {fleet.url("ct129"), fleet.url("ct130", 30001)}


def test_a_host_that_fails_its_probe_stays_out_while_the_router_serves_from_the_rest(fleet: Fleet):
    fault = ["-e", json.dumps({"sglang_extra_env": {"DDTREE_LAB_FAULT": "hidden_none"}})]
    with fleet.watch() as watch, Traffic(fleet.router) as routed:
        run = _play(fleet.lab, "deploy.yml", "-l", "ct129", *fault)
    message = " ".join(run.stdout.split())
    assert run.returncode != 0 and "hidden_states_missing" in message, message[-3000:]
    assert "It stays out of its routers' rotation (ct131)" in message, message[-3000:]
    figures = routed.figures()
    print(json.dumps({"scenario": "failed probe ct129", "through_router": figures,
                      "out_of_rotation_s": watch.out_of_rotation_s(fleet.lab.addresses["ct129"])}))
    assert figures["requests"] > 50 and figures["failures"] == 0, figures
    ct130 = fleet.url("ct130", 30001)
    assert fleet.serving() == {ct130}  # rolled back and serving, but out until someone puts it back
    back = _play(fleet.lab, "ansible/rotation.yml", "-l", "ct129", "-e", "rotation=join")
    assert back.returncode == 0, back.stdout[-4000:]
    assert fleet.serving() == {fleet.url("ct129"), ct130}


def test_fleet_status_shows_each_hosts_rotation(fleet: Fleet):
    from tests.lab.conftest import ddtree

    inventories = ["-i", str(fleet.lab.inventory), "-i", str(ROUTER_INVENTORY)]
    proc = ddtree("fleet", "status", *inventories, "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    rotation = {row["host"]: row["rotation"] for row in json.loads(proc.stdout)["rows"]}
    assert rotation == {"ct129": [f"{ROUTER}: in"], "ct130": [f"{ROUTER}: in"], "ct131": None}, rotation
