"""Issue 36: what a router says is checked before anything is decided on it.

The rotation's decisions (ops/rotation.py, through its command line as the plays call it), the rotation
role against a lying router on loopback (real ansible-playbook), `ddtree fleet status`'s router column
(the real router script against a loopback router) and the canary's traffic verdict (ops/canary_traffic.py)
on answers a careless or compromised router gives: strings for booleans, ids that are paths, URLs in other
spellings, with credentials, newlines or flags, lists where objects belong, NaN and counters going back.
Each case failed (a traceback, a wrong removal, a promotion) before the change that added it.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddtree_runtime.inputs import router_answers
from ddtree_runtime.ops import canary_traffic, fleet_status, rotation
from ddtree_runtime.ops.fleet_inventory import RouterTarget, Target
from tests.unit._ansible import PLAYBOOKS, REPO, tool_env
from tests.unit.hostile_http import HostileServer, respond

A, B = "10.0.0.1", "10.0.0.2"
MINE = f"http://{A}:30000"


_IDS = itertools.count()


def _w(url: Any, healthy: Any = True, wid: Any = None) -> dict:
    return {"id": wid if wid is not None else f"w{next(_IDS)}", "url": url, "is_healthy": healthy}


def _cli(module: str, *args: str, doc: Any) -> tuple[int, dict, str]:
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        input=doc if isinstance(doc, str) else json.dumps(doc),
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def _leave(workers: Any, **over: Any) -> tuple[int, dict, str]:
    doc = {
        "host": "ct129",
        "urls": [MINE],
        "batch_addresses": [],
        "allow_single_host": False,
        "restart_bound_s": 150,
        "routers": [
            {
                "name": "r1",
                "workers": workers,
                "members": [{"host": "ct129", "address": A}, {"host": "ct130", "address": B}],
            }
        ],
    }
    return _cli("ddtree_runtime.ops.rotation", "leave", doc={**doc, **over})


# ---------------------------------------------------------------------------- the rotation's decisions


@pytest.mark.parametrize(
    ("workers", "said"),
    [
        # health a JSON boolean: "false" was truthy, so the last truly healthy worker went out
        (
            {"workers": [_w(MINE), _w(f"http://{B}:30000", "false")]},
            "is_healthy: 'false' is not a JSON boolean",
        ),
        ({"workers": [_w(MINE), _w(f"http://{B}:30000", "0")]}, "is_healthy: '0' is not a JSON boolean"),
        ({"workers": [_w(MINE), _w(f"http://{B}:30000", [0])]}, "is_healthy: [0] is not a JSON boolean"),
        ({"workers": [_w(MINE), _w(f"http://{B}:30000", 1)]}, "is_healthy: 1 is not a JSON boolean"),
        # ids go into DELETE /workers/<id>
        (
            {"workers": [_w(MINE, wid="../../workers/b2?all=1"), _w(f"http://{B}:30000")]},
            "is not a worker id",
        ),
        ({"workers": [_w(MINE, wid=""), _w(f"http://{B}:30000")]}, "worker 0 id: '' is not a worker id"),
        ({"workers": [_w(MINE, wid="x" * 100_000), _w(f"http://{B}:30000")]}, "is not a worker id"),
        ({"workers": [{"url": MINE, "is_healthy": True}]}, "worker 0 id: None is not a worker id"),
        # URLs: a list, credentials (never shown), spaces and newlines
        ({"workers": [_w([MINE])]}, "url: ['http://10.0.0.1:30000'] is not a URL string"),
        ({"workers": [_w(f"http://admin:hunter2@{A}:30000")]}, "url: (value hidden) holds credentials"),
        ({"workers": [_w(MINE), _w("not a url")]}, "url: 'not a url' holds a space or a control character"),
        ({"workers": [_w(f"http://{B}:30000\nSGLANG=1")]}, "holds a space or a control character"),
        # not a worker list at all
        ({"workers": [MINE]}, "router r1 worker 0: 'http://10.0.0.1:30000' is not an object"),
        (5, "router r1: its GET /workers answer 5 is not a worker list"),
        (None, "router r1: its GET /workers answer None is not a worker list"),
    ],
)
def test_a_router_answer_that_cannot_be_trusted_is_exit_2_one_line_and_no_change(workers: Any, said: str):
    code, answer, err = _leave(workers)
    assert code == rotation.EXIT_BAD_INPUT and answer["ok"] is False, answer
    assert said in answer["reason"] and "nothing was decided on it" in answer["reason"], answer["reason"]
    assert err == "" and "\n" not in answer["reason"] and len(answer["reason"]) < 600
    assert "hunter2" not in answer["reason"] and "removals" not in answer


@pytest.mark.parametrize(
    ("doc", "said"),
    [
        ("[" * 100_000, "stdin is not JSON"),
        ({"restart_bound_s": "soon"}, "'restart_bound_s' must be a number of seconds: got 'soon'"),
        ({"restart_bound_s": float("nan")}, "'restart_bound_s' must be a number of seconds"),
        ({"allow_single_host": "maybe"}, "'allow_single_host' must be a boolean"),
        ({"urls": ["file:///etc/passwd"]}, "'urls' must be an http(s) worker URL"),
        ({"host": ["ct129"]}, "'host' must be the inventory name"),
    ],
)
def test_the_plays_own_fields_are_checked_too(doc: Any, said: str):
    if isinstance(doc, str):
        code, answer, err = _cli("ddtree_runtime.ops.rotation", "leave", doc=doc)
    else:
        code, answer, err = _leave({"workers": [_w(MINE), _w(f"http://{B}:30000")]}, **doc)
    assert code == rotation.EXIT_BAD_INPUT and said in answer["reason"] and err == "", (answer, err)


@pytest.mark.parametrize(
    "other",
    [
        _w("file:///etc/passwd"),  # not http(s): serves nothing of ours
        _w("gopher://10.0.0.2:70"),
        _w("http://ct130.example:30000"),  # a DNS name may be this very host: not evidence of capacity
    ],
)
def test_only_http_workers_at_an_ip_address_count_as_serving_capacity(other: dict):
    code, answer, _ = _leave({"workers": [_w(MINE), other]})
    assert (
        code == rotation.EXIT_REFUSED and "ct129 is the last healthy worker of router r1" in answer["reason"]
    )


@pytest.mark.parametrize(
    "spelling", [f"HTTP://{A}:30000", f"http://{A}:30000/", f"Http://{A}:30000//", "http://10.0.0.1:30000"]
)
def test_the_hosts_worker_is_recognised_in_any_spelling_so_it_leaves_before_the_restart(spelling: str):
    code, answer, _ = _leave({"workers": [_w(spelling, wid="w-a"), _w(f"http://{B}:30000", wid="w-b")]})
    assert code == rotation.EXIT_GO and answer["removals"] == [{"router": "r1", "id": "w-a", "url": MINE}]
    v6 = rotation.RouterView(
        "r1",
        (rotation.Member("ct129", "FD00::7"),),
        ({"workers": [_w("http://[fd00:0::7]:30000/", wid="w6")]},)[0],
    )
    assert rotation.plan_join("http://[fd00::7]:30000", [v6])["already"] == ["r1"]
    assert rotation.host_states([v6]) == {"ct129": ["r1: in"]}


def test_the_shadow_is_removed_by_checked_ids_in_any_spelling():
    shadow = f"http://{A}:30001"
    doc = {
        "url": shadow,
        "routers": [
            {
                "name": "r1",
                "members": [],
                "workers": {"workers": [_w(MINE, wid="live"), _w(f"HTTP://{A}:30001/", wid="shadow")]},
            }
        ],
    }
    code, answer, _ = _cli("ddtree_runtime.ops.rotation", "remove", doc=doc)
    assert code == rotation.EXIT_GO and answer["removals"] == [
        {"router": "r1", "id": "shadow", "url": shadow}
    ]
    doc["routers"][0]["workers"]["workers"][1]["id"] = "../live"
    code, answer, _ = _cli("ddtree_runtime.ops.rotation", "remove", doc=doc)
    assert code == rotation.EXIT_BAD_INPUT and "'../live' is not a worker id" in answer["reason"]


def test_the_rotation_file_gets_checked_urls_in_one_spelling_or_nothing():
    answer = {"workers": [_w(f"HTTP://{B}:30000/"), _w(MINE), _w("file:///etc/passwd")]}
    assert router_answers.router_rotation_urls(answer, "r1") == [MINE, f"http://{B}:30000"]
    for url in (f"http://{B}:30000\nLD_PRELOAD=/tmp/x.so", f"http://{B}:30000 --host 0.0.0.0"):
        with pytest.raises(router_answers.InputError, match="router r1 worker 0 url"):
            router_answers.router_rotation_urls({"workers": [_w(url)]}, "r1")
    assert (
        router_answers.router_rotation_urls({"workers": [_w("--host")]}, "r1") == []
    )  # not http(s): left out


# ---------------------------------------------------------------------------- the rotation role, lying router


class _Sequence:
    """GET /workers answers in turn (the last one repeats); DELETEs are seen by the server's log."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)

    def __call__(self, handler: Any) -> None:
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        respond(200, answer)(handler)


def _inventory(tmp: Path, router_port: int) -> Path:
    common = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    state = tmp / "w1-state"
    state.mkdir()
    (tmp / "router-state").mkdir()
    hosts = {
        "w1": {
            "ansible_host": "127.0.0.1",
            "sglang_rotation_port": 1,
            "sglang_rotation_shadow_port": 2,
            "sglang_rotation_state_dir": str(state),
            "sglang_rotation_drain_timeout": 5,
        },
        "w2": {"ansible_host": "127.0.0.2"},
    }
    for h in hosts.values():
        h.update(sglang_service_host="0.0.0.0", sglang_service_allowed_clients=["127.0.0.0/8"])
    inv = {
        "all": {
            "vars": common,
            "children": {
                "sglang_routers": {
                    "hosts": {
                        "r1": {
                            "ansible_host": "127.0.0.1",
                            "sglang_router_workers": ["w1", "w2"],
                            "sglang_router_port": router_port,
                            "sglang_router_state_dir": str(tmp / "router-state"),
                        }
                    }
                },
                "gpu_hosts": {"hosts": hosts},
            },
        }
    }
    path = tmp / "inventory.yml"
    path.write_text(yaml.safe_dump(inv))
    return path


def _step(inventory: Path, action: str, *, ok: bool = False) -> str:
    cmd = [
        str(Path(sys.executable).parent / "ansible-playbook"),
        "-i",
        str(inventory),
        str(PLAYBOOKS / "rotation.yml"),
        "-e",
        "target=w1",
        "-e",
        f"rotation_action={action}",
    ]
    res = subprocess.run(cmd, cwd=REPO, env=tool_env(), capture_output=True, text=True, timeout=300)
    assert (res.returncode == 0) is ok, res.stdout[-3000:]
    return " ".join(res.stdout.split())


W1, W2 = "http://127.0.0.1:1", "http://127.0.0.2:1"


def test_the_rotation_role_sends_no_delete_for_an_id_that_is_a_path(tmp_path: Path):
    answer = {"workers": [_w(W1, wid="../../workers/b2?all=1"), _w(W2, wid="b2")]}
    with HostileServer({"/workers": _Sequence(answer)}) as router:
        out = _step(_inventory(tmp_path, int(router.url.rsplit(":", 1)[1])), "leave")
        paths = [p for p, _ in router.seen]
    assert (
        "router_answer_refused: bad input: router r1 worker 0 id: '../../workers/b2?all=1' is not a worker id"
        in out
    ), out[-3000:]
    assert "Nothing was changed on w1" in out and set(paths) == {"/workers"}, paths  # GETs only


def test_the_rotation_role_sends_no_delete_for_the_shadow_on_an_answer_it_cannot_trust(tmp_path: Path):
    answer = {"workers": [_w(W1, wid="live"), _w("http://127.0.0.1:2", wid="../live"), _w(W2, wid="b2")]}
    with HostileServer({"/workers": _Sequence(answer)}) as router:
        out = _step(_inventory(tmp_path, int(router.url.rsplit(":", 1)[1])), "remove_shadow")
        paths = [p for p, _ in router.seen]
    assert "router_answer_refused" in out and "'../live' is not a worker id" in out, out[-3000:]
    assert set(paths) == {"/workers"}, paths


def test_the_shadow_in_another_spelling_leaves_and_the_rotation_file_keeps_one_spelling(tmp_path: Path):
    before = {"workers": [_w(W1, wid="live"), _w("HTTP://127.0.0.1:2/", wid="sid"), _w(W2 + "/", wid="b2")]}
    gone = {"workers": [_w(W1, wid="live"), _w(W2 + "/", wid="b2")]}
    # GETs: the preflight's, remove_shadow's, its wait until the shadow is gone, the record's
    answers = _Sequence(before, before, gone)
    with HostileServer({"/workers": answers, "/workers/sid": respond(202, {})}) as router:
        _step(_inventory(tmp_path, int(router.url.rsplit(":", 1)[1])), "remove_shadow", ok=True)
        paths = [p for p, _ in router.seen]
    assert paths.count("/workers/sid") == 1 and "/workers/live" not in paths, paths
    text = (tmp_path / "router-state" / "workers.env").read_text()
    assert f"SGLANG_ROUTER_WORKER_URLS={W1} {W2}\n" in text, text


def test_a_listed_url_with_a_newline_never_reaches_the_rotation_file(tmp_path: Path):
    """The host leaves (its entry has a good id), then the router lists a URL that would add a line to the
    env file its next start reads: the record step stops, the file is not written."""
    before = {"workers": [_w(W1, wid="a1"), _w(W2, wid="b2")]}
    gone = {"workers": [_w(W2, wid="b2")]}
    after = {"workers": [_w(W2 + "\nSGLANG_ROUTER_CONTROL_KEYS=", wid="b2")]}
    # GETs: the preflight's, the leave's, its wait until w1 is gone, the record's
    answers = _Sequence(before, before, gone, after)
    with HostileServer({"/workers": answers, "/workers/a1": respond(202, {})}) as router:
        inventory = _inventory(tmp_path, int(router.url.rsplit(":", 1)[1]))
        out = _step(inventory, "leave")
        paths = [p for p, _ in router.seen]
    assert "/workers/a1" in paths  # it did leave
    assert "router r1 worker 0 url" in out and "holds a space or a control character" in out, out[-3000:]
    assert not (tmp_path / "router-state" / "workers.env").exists()


# ---------------------------------------------------------------------------- ddtree fleet status


@pytest.mark.parametrize(
    ("answer", "cell"),
    [
        ([], "r1: ? (malformed answer: [] is not a worker list)"),
        (5, "r1: ? (malformed answer: 5 is not a worker list)"),
        ({"workers": [1, "x"]}, "r1: ? (malformed answer: router r1 worker 0: 1 is not an object"),
        (
            {"workers": [_w(f"http://{A}:30000", "false")]},
            "r1: ? (malformed answer: router r1 worker 0 is_healthy",
        ),
        ("[" * 100_000, "r1: ? (no answer (maximum recursion depth exceeded"),
        ({"workers": [_w(f"HTTP://{A}:30000/")]}, "r1: in"),
    ],
)
def test_fleet_status_survives_a_router_that_answers_anything(answer: Any, cell: str, monkeypatch):
    """The real router script (as SSH runs it on the router host) against a loopback router that lies."""

    def run_here(_target: Target, command: str, stdin_text: str | None = None) -> tuple[int, str, str]:
        assert command == "python3 -"
        proc = subprocess.run(
            [sys.executable, "-"], input=stdin_text, capture_output=True, text=True, timeout=30
        )
        return proc.returncode, proc.stdout, proc.stderr

    monkeypatch.setattr(fleet_status, "run_remote", run_here)
    with HostileServer({"/workers": respond(200, answer)}) as server:
        port = int(server.url.rsplit(":", 1)[1])
        router = RouterTarget(Target("r1", "127.0.0.1"), port, "", (("ct129", A), ("ct130", B)))
        states = fleet_status.rotation_states([router])
    assert states["ct129"][0].startswith(cell), states
    assert len(states["ct130"]) == 1


# ---------------------------------------------------------------------------- the canary's traffic verdict


LIVE, SHADOW = f"http://{A}:30000", f"http://{A}:30001"
NAME = "sglang:e2e_request_latency_seconds"


def _router(outcomes: dict[str, tuple[Any, Any]]) -> str:
    lines = ["# TYPE smg_worker_cb_outcomes_total counter"]
    for url, (ok, bad) in outcomes.items():
        lines.append(f'smg_worker_cb_outcomes_total{{worker="{url}",outcome="success"}} {ok}')
        lines.append(f'smg_worker_cb_outcomes_total{{worker="{url}",outcome="failure"}} {bad}')
    return "\n".join(lines) + "\n"


def _engine(n: int, mean: float = 0.07, total: Any = None, inf_bucket: Any = None, le: str = "0.1") -> str:
    return (
        "\n".join(
            [
                f"# TYPE {NAME} histogram",
                f'{NAME}_bucket{{le="{le}"}} {n}',
                f'{NAME}_bucket{{le="+Inf"}} {n if inf_bucket is None else inf_bucket}',
                f"{NAME}_count {n}",
                f"{NAME}_sum {n * mean if total is None else total}",
            ]
        )
        + "\n"
    )


def _traffic(**over: Any) -> dict:
    doc = {
        "live_url": LIVE,
        "shadow_url": SHADOW,
        "routers_before": [_router({LIVE: (100, 0)})],
        "routers_after": [_router({LIVE: (160, 0), SHADOW: (30, 0)})],
        "live_before": _engine(100),
        "live_after": _engine(160),
        "shadow_before": _engine(0),
        "shadow_after": _engine(30),
        "window_s": 10,
        "thresholds": {"min_requests": 20},
    }
    return {**doc, **over}


def test_the_traffic_baseline_promotes():
    assert canary_traffic.run(_traffic())["verdict"] == "promote"


@pytest.mark.parametrize(
    ("over", "said"),
    [
        ({"live_after": _engine(160, total=1.0)}, f"{LIVE}: latency sum went down (7 -> 1)"),
        ({"routers_after": [_router({LIVE: (90, 0), SHADOW: (30, 0)})]}, f"{LIVE}: successes went down"),
        ({"routers_after": [_router({LIVE: (160, 0)})]}, f"{SHADOW}: the routers recorded no outcome for it"),
        ({"shadow_after": "# nothing\n"}, f"{SHADOW}: its engine reports no {NAME} histogram"),
        ({"shadow_after": _engine(5)}, f"{SHADOW}: request count went down (30 -> 5)"),
    ],
)
def test_the_traffic_verdict_aborts_on_evidence_it_cannot_read_and_says_why(over: dict, said: str):
    if "shadow_after" in over and "went down" in said:  # a restarted shadow: before > after
        over = {"shadow_before": _engine(30), **over}
    report = canary_traffic.run(_traffic(**over))
    assert report["verdict"] == "abort" and said in report["reason"], report["reason"]
    assert report["reason"].startswith("evidence that cannot be judged")


def test_failures_recorded_under_another_spelling_of_the_shadows_url_count():
    spelled = f"HTTP://{A}:30001/"
    report = canary_traffic.run(_traffic(routers_after=[_router({LIVE: (160, 0), spelled: (20, 10)})]))
    assert report["verdict"] == "abort" and "the shadow failed 10 of 30 requests" in report["reason"], report


@pytest.mark.parametrize(
    ("over", "said"),
    [
        ({"shadow_after": _engine(30, total="NaN")}, f"{SHADOW}: latency sum is not a finite number"),
        ({"shadow_after": _engine(30, total="+Inf")}, f"{SHADOW}: latency sum is not a finite number"),
        (
            {"routers_after": [_router({LIVE: (160, 0), SHADOW: (30, "NaN")})]},
            "failures is not a finite number",
        ),
        ({"shadow_after": _engine(30, inf_bucket="NaN")}, "holds nan: not a count"),
        ({"shadow_after": _engine(30, inf_bucket="+Inf")}, "holds inf: not a count"),
        ({"shadow_after": _engine(30, le="NaN")}, "bucket le=NaN"),
        ({"shadow_after": _engine(30, le="fast")}, "a bucket without a numeric le"),
        ({"shadow_after": _engine(30, inf_bucket="many")}, "not Prometheus text"),
        ({"shadow_after": 5}, "metrics must be Prometheus text"),
        ({"thresholds": {"max_latency_ratio": float("nan")}}, "threshold max_latency_ratio must be a finite"),
        ({"window_s": "ten"}, "window_s must be a finite number of seconds"),
    ],
)
def test_unreadable_buckets_are_a_clean_exit_2(over: dict, said: str):
    code, report, err = _cli("ddtree_runtime.ops.canary_traffic", doc=json.dumps(_traffic(**over)))
    assert code == canary_traffic.EXIT_BAD_INPUT and report["verdict"] == "abort", report
    assert said in report["reason"] and err == "", (report["reason"], err)
