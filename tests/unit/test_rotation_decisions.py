"""ddtree_runtime/ops/rotation.py (which router workers a rollout takes out and puts back, and whether it
may) and ops/canary_traffic.py (the shadow's real traffic against live's), on the routers' own answer
shapes; both through their command line as the plays call them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ddtree_runtime.ops import canary_traffic, rotation
from ddtree_runtime.ops.rotation import Member, RouterView

A, B, C = "10.0.0.1", "10.0.0.2", "10.0.0.3"
MEMBERS = (Member("ct129", A), Member("ct130", B), Member("ct131", C))


def worker(address: str, port: int = 30000, healthy: bool = True) -> dict:
    return {"id": f"id-{address}-{port}", "url": f"http://{address}:{port}", "is_healthy": healthy}


def router(*workers: dict, members: tuple[Member, ...] = MEMBERS, name: str = "r1") -> RouterView:
    return RouterView(name, members, tuple(workers))


def leave(view: RouterView, *, urls=(f"http://{A}:30000",), batch=(), allow=True) -> dict:
    return rotation.plan_leave(
        "ct129", set(urls), set(batch), [view], allow_single_host=allow, restart_bound_s=150
    )


def test_a_host_leaves_while_another_worker_serves_and_every_url_of_it_goes():
    answer = leave(
        router(worker(A, 30001), worker(A), worker(B)), urls=(f"http://{A}:30000", f"http://{A}:30001")
    )  # a profile switch moves the port
    assert answer["ok"] and answer["reason"] is None and answer["warnings"] == []
    assert {r["url"] for r in answer["removals"]} == {f"http://{A}:30000", f"http://{A}:30001"}


def test_the_last_healthy_worker_stays_and_the_reason_names_the_others():
    answer = leave(router(worker(A), worker(B, healthy=False)))
    assert not answer["ok"]
    assert (
        "ct129 is the last healthy worker of router r1 (ct130 in rotation but UNHEALTHY, "
        "ct131 not in rotation)"
    ) in answer["reason"]
    assert "Nothing was changed" in answer["reason"] and "sglang_rotation_enabled=false" in answer["reason"]


def test_hosts_of_the_same_batch_do_not_count_as_serving():
    assert leave(router(worker(A), worker(B)))["ok"]
    answer = leave(router(worker(A), worker(B)), batch=(B,))  # serial 2: ct130 goes out at the same time
    assert not answer["ok"] and "ct130 in this batch" in answer["reason"]


def test_a_host_out_of_rotation_may_restart_whatever_the_rest_does():
    answer = leave(router(worker(B, healthy=False)))
    assert answer == {"ok": True, "reason": None, "warnings": [], "removals": []}


def test_a_routers_only_worker_goes_with_the_downtime_said_or_is_refused():
    alone = router(worker(A), members=(Member("ct129", A),))
    answer = leave(alone)
    assert answer["ok"] and answer["warnings"] == [
        "ct129 is the only worker of router r1: requests through it fail until ct129 is back, up to 150 s "
        "(its stop plus its ready timeout)."
    ]
    refused = leave(alone, allow=False)
    assert not refused["ok"] and "sglang_rotation_allow_single_host_downtime is false" in refused["reason"]


def test_join_adds_only_where_missing_and_states_per_host():
    r1, r2 = router(worker(A), worker(B)), router(worker(B), name="r2")
    assert rotation.plan_join(f"http://{A}:30000", [r1, r2]) == {
        "ok": True,
        "additions": ["r2"],
        "already": ["r1"],
    }
    states = rotation.host_states([router(worker(A), worker(B, healthy=False))])
    assert states == {"ct129": ["r1: in"], "ct130": ["r1: in (unhealthy)"], "ct131": ["r1: out"]}
    assert rotation.worker_url("fd00::7", 30000) == "http://[fd00::7]:30000"
    assert rotation.url_address("http://[fd00::7]:30000") == "fd00::7"


def _cli(module: str, *args: str, doc: object) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        input=json.dumps(doc) if not isinstance(doc, str) else doc,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, json.loads(proc.stdout)


def test_exposure_the_routers_reach_a_wildcard_listener_that_admits_them():
    """The preflight's check (roles/sglang_rotation): SGLang beyond loopback, each router admitted."""
    assert rotation.plan_exposure("0.0.0.0", ["10.0.0.0/24"], [("r1", A)]) == {"ok": True, "reason": ""}
    assert rotation.plan_exposure("::", ["any"], [("r1", "router.example")])["ok"]
    answer = rotation.plan_exposure("127.0.0.1", [], [("r1", A)])
    assert not answer["ok"]
    assert answer["reason"] == f"SGLang listens on 127.0.0.1 and admits only localhost; not reached: r1 ({A})"
    answer = rotation.plan_exposure("0.0.0.0", ["10.0.1.0/24"], [("r1", A), ("r2", "10.0.1.5")])
    assert answer["reason"] == f"SGLang listens on 0.0.0.0 and admits ['10.0.1.0/24']; not reached: r1 ({A})"
    answer = rotation.plan_exposure("0.0.0.0", ["10.0.0.0/24"], [("r1", "router.example")])
    assert answer["reason"].startswith("the router address 'router.example' is not an IP address")
    assert rotation.run("exposure", {"host": "0.0.0.0", "allowed": [], "routers": []})[0] == rotation.EXIT_GO
    for doc in (
        {"host": "0.0.0.0", "allowed": "any", "routers": []},
        {"host": "0.0.0.0", "allowed": ["not a network"], "routers": []},
        {"host": "0.0.0.0", "allowed": [], "routers": [["r1"]]},
    ):
        with pytest.raises(rotation.RotationInputError):
            rotation.run("exposure", doc)


def test_rotation_command_line_as_the_plays_call_it():
    doc = {
        "host": "ct129",
        "urls": [f"http://{A}:30000"],
        "batch_addresses": [],
        "allow_single_host": True,
        "restart_bound_s": 150,
        "routers": [
            {
                "name": "r1",
                "members": [{"host": "ct129", "address": A}, {"host": "ct130", "address": B}],
                "workers": {"workers": [worker(A), worker(B, healthy=False)]},
            }
        ],
    }
    code, answer = _cli("ddtree_runtime.ops.rotation", "leave", doc=doc)
    assert code == rotation.EXIT_REFUSED and "last healthy worker" in answer["reason"]
    code, answer = _cli(
        "ddtree_runtime.ops.rotation", "leave", doc={"routers": [{"name": "r1", "workers": 3}]}
    )
    assert code == rotation.EXIT_BAD_INPUT and "GET /workers answer" in answer["reason"]
    code, answer = _cli("ddtree_runtime.ops.rotation", "dance", doc={"routers": []})
    assert code == rotation.EXIT_BAD_INPUT and "unknown action 'dance'" in answer["reason"]


# ---------------------------------------------------------------------------- canary traffic


def _router_text(outcomes: dict[str, tuple[int, int]]) -> str:
    lines = ["# TYPE smg_worker_cb_outcomes_total counter"]
    for url, (ok, bad) in outcomes.items():
        lines.append(f'smg_worker_cb_outcomes_total{{worker="{url}",outcome="success"}} {ok}')
        lines.append(f'smg_worker_cb_outcomes_total{{worker="{url}",outcome="failure"}} {bad}')
    return "\n".join(lines) + "\n"


def _engine_text(latencies: list[float]) -> str:
    bounds = (0.05, 0.1, 0.25, 0.5, 1.0, float("inf"))
    name = "sglang:e2e_request_latency_seconds"
    lines = [f"# TYPE {name} histogram"]
    for le in bounds:
        shown = "+Inf" if le == float("inf") else repr(le)
        lines.append(f'{name}_bucket{{le="{shown}",model_name="m"}} {sum(x <= le for x in latencies)}')
    lines += [
        f'{name}_count{{model_name="m"}} {len(latencies)}',
        f'{name}_sum{{model_name="m"}} {sum(latencies)}',
    ]
    return "\n".join(lines) + "\n"


LIVE, SHADOW = "http://10.0.0.1:30000", "http://10.0.0.1:30001"


def _judge(shadow_latency: float, shadow_failures: int, shadow_requests: int = 30, **thresholds) -> dict:
    doc = {
        "live_url": LIVE,
        "shadow_url": SHADOW,
        "routers_before": [_router_text({LIVE: (100, 1)})],
        "routers_after": [_router_text({LIVE: (160, 1), SHADOW: (shadow_requests, shadow_failures)})],
        "live_before": _engine_text([0.07] * 101),
        "live_after": _engine_text([0.07] * 161),
        "shadow_before": _engine_text([]),
        "shadow_after": _engine_text([shadow_latency] * shadow_requests),
        "window_s": 12,
        "thresholds": thresholds,
    }
    return canary_traffic.run(doc)


def test_a_shadow_as_good_as_live_promotes():
    report = _judge(0.08, 0)
    assert report["verdict"] == "promote", report
    assert report["live"]["requests"] == 60 and report["shadow"]["requests"] == 30
    assert report["shadow"]["latency_p50_s"] == pytest.approx(0.075) and report["live"]["failures"] == 0
    assert report["table"][-1] == "canary traffic PROMOTE (30 real requests in 12 s)"


@pytest.mark.parametrize(
    ("latency", "failures", "requests", "why"),
    [
        (0.08, 3, 30, "the shadow failed 3 of 33 requests (9.1%), live 0 of 60 (0.0%)"),
        (0.4, 0, 30, "the shadow's mean latency 0.400 s is above 0.205 s (1.5 x live's 0.070 s + 0.1 s)"),
        (0.08, 0, 5, "the shadow served 5 request(s) of real traffic, fewer than the 20 needed"),
    ],
)
def test_a_shadow_worse_than_live_aborts_with_the_figures(latency, failures, requests, why):
    report = _judge(latency, failures, requests)
    assert report["verdict"] == "abort" and why in report["reason"], report["reason"]


def test_an_allowed_error_increase_and_bad_input():
    assert _judge(0.08, 1, max_error_rate_increase=0.05)["verdict"] == "promote"
    code, report = _cli("ddtree_runtime.ops.canary_traffic", doc="{not json")
    assert code == canary_traffic.EXIT_BAD_INPUT and report["verdict"] == "abort"
    code, report = _cli("ddtree_runtime.ops.canary_traffic", doc={"live_url": LIVE})
    assert code == canary_traffic.EXIT_BAD_INPUT and "missing or malformed field" in report["reason"]
