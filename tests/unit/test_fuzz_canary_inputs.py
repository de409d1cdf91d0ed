"""`ddtree canary compare` against loopback servers that lie (issue 23, class 5): the canary never promotes
on evidence it cannot trust, and bad shapes or bad arguments end in a verdict or exit 2, never a traceback.

The servers answer every request of a path the same way (tests/unit/hostile_http.py), so one case is one
shape of evidence; tests/unit/test_canary.py covers real lab-engine servers.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import pytest

from ddtree_runtime.health import canary
from ddtree_runtime.health.canary import Answer, CanaryInputError, Side, Thresholds
from tests.unit.hostile_http import HostileServer, raw, respond


def info(instance: str | None, port: int = 30000, **extra: Any) -> dict[str, Any]:
    doc = {
        "version": "0.5.23",
        "ddtree_runtime_version": "1.0",
        "speculative_algorithm": "DDTREE",
        "port": port,
        "random_seed": 7,
        "ddtree_handshake": {"budget": 16, "block_size": 16, "status": "ok"},
    }
    if instance:
        doc["ddtree_instance_id"] = instance
    return {**doc, **extra}


def answer(
    text: str = " Paris.", ids: list[int] | None = None, completion: int | None = None, verify: int | None = 2
) -> dict[str, Any]:
    ids = [11, 12, 13, 14] if ids is None else ids
    meta: dict[str, Any] = {"completion_tokens": len(ids) if completion is None else completion}
    if verify is not None:
        meta["spec_verify_ct"] = verify
    return {"text": text, "output_ids": ids, "meta_info": meta}


def routes(server_info: Any, generate: Any) -> dict:
    info_route = server_info if callable(server_info) else respond(200, server_info)
    return {
        "/health_generate": respond(200, ""),
        "/server_info": info_route,
        "/generate": generate if callable(generate) else respond(200, generate),
    }


def run(live: dict, shadow: dict, **kw: Any) -> canary.CanaryReport:
    with HostileServer(live) as a, HostileServer(shadow) as b:
        return canary.compare(
            a.url,
            b.url,
            prompts=["p"],
            rounds=1,
            max_new_tokens=4,
            ready_timeout=5,
            request_timeout=5,
            thresholds=Thresholds(max_latency_ratio=1000.0),
            **kw,
        )


def test_two_honest_servers_promote():
    report = run(routes(info("a"), answer()), routes(info("b", 30001), answer()))
    assert report.verdict == "promote", report.reason


@pytest.mark.parametrize(
    ("shadow", "said"),
    [
        (answer(text=""), "the same token ids but another text"),
        (answer(text=" Lyon."), "the same token ids but another text"),
        (answer(ids=[11, 12, 13, 99]), "at token 3"),
    ],
)
def test_text_and_ids_must_both_agree(shadow, said):
    report = run(routes(info("a"), answer()), routes(info("b", 30001), shadow))
    assert report.verdict == "abort" and report.exit_code == 1
    assert said in next(c.detail for c in report.checks if c.name == "tokens")


@pytest.mark.parametrize(
    ("shadow", "said"),
    [
        (answer(completion=40), "completion_tokens 40 but 4 output ids"),
        (answer(ids=[], completion=0), "no output tokens"),
        (answer(verify=0), "0 verify steps for 4 tokens"),
        (answer(verify=9), "9 verify steps for 4 tokens"),
        (answer(ids=list(range(40)), verify=2), "more than the drafter block of 16"),
        (answer(ids=["11", 12]), "is not a token id"),
        ({"text": None, "output_ids": [1], "meta_info": {}}, "is not a string"),
        ({"text": "x", "output_ids": [1], "meta_info": []}, "never answers"),
    ],
)
def test_counts_that_contradict_the_ids_are_not_evidence(shadow, said):
    report = run(routes(info("a"), answer()), routes(info("b", 30001), shadow))
    assert report.verdict == "abort" and report.checks[0].name == "generate", report.reason
    assert said in report.reason


def test_live_compared_with_itself_under_two_spellings_is_refused():
    with HostileServer(routes(info("same-process"), answer())) as one:
        port = one.url.rsplit(":", 1)[1]
        with pytest.raises(CanaryInputError, match=r"same server"):
            canary.compare(
                f"http://127.0.0.1:{port}",
                f"http://localhost:{port}",
                prompts=["p"],
                rounds=1,
                ready_timeout=5,
                request_timeout=5,
            )


@pytest.mark.parametrize("spelling", ["http://127.0.0.1:0{port}", "HTTP://127.0.0.1:{port}/",
                                      "http://LocalHost:{port}", "http://[::ffff:127.0.0.1]:{port}",
                                      "http://127.0.0.1:000{port}//"])
def test_any_spelling_of_lives_address_is_refused_before_any_request(spelling):
    """Without identity in /server_info (no instance id, no seed) only the address can tell: normalised
    (scheme and host case, leading zeros, trailing slashes) and resolved, it is live's own."""
    bare = {"version": "0.5.23", "speculative_algorithm": "DDTREE"}
    with HostileServer(routes(bare, answer())) as one:
        port = int(one.url.rsplit(":", 1)[1])
        with pytest.raises(CanaryInputError, match=r"same server \((the same URL|both reach 127\.0\.0\.1)"):
            canary.compare(one.url, spelling.format(port=port), prompts=["p"], rounds=1, ready_timeout=5,
                           request_timeout=5)


def test_default_ports_are_written_out():
    assert canary._base("HTTP://Example.COM/", "--live") == "http://example.com:80"
    assert canary._base("https://[::1]", "--live") == "https://[::1]:443"
    assert canary.same_address(canary._base("http://127.0.0.1", "--live"),
                               canary._base("http://127.0.0.1:080", "--shadow"))


def test_two_addresses_that_report_one_instance_are_one_server():
    """A proxy in front of live, or live twice: what the servers say about themselves decides."""
    with pytest.raises(CanaryInputError, match=r"same server.*both report instance same-process"):
        run(routes(info("same-process"), answer()), routes(info("same-process", 30001), answer()))


def test_servers_that_cannot_be_told_apart_abort():
    bare = {"version": "0.5.23", "speculative_algorithm": "DDTREE", "port": 30000}
    report = run(routes(bare, answer()), routes(info("b", 30001), answer()))
    assert report.verdict == "abort" and report.exit_code == 1 and "tell the servers apart" in report.reason


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://127.0.0.1:-1", "http://127.0.0.1:abc",
                                 "http://[::1", "http://"])
def test_a_bad_url_is_one_line_exit_2(url):
    res = subprocess.run([sys.executable, "-m", "ddtree_runtime", "canary", "compare", "--live", url,
                          "--shadow", "http://127.0.0.1:30001"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stdout + res.stderr
    assert res.stdout.count("\n") == 1 and res.stdout.startswith("canary ABORT: --live"), res.stdout
    assert "not a valid URL" in res.stdout or "not an http(s) URL" in res.stdout, res.stdout


def test_without_instance_ids_port_and_seed_tell_servers_apart():
    same = routes(info(None, 30000), answer())
    with pytest.raises(CanaryInputError, match="both report port 30000 and random seed 7"):
        run(same, routes(info(None, 30000), answer()))
    report = run(same, routes(info(None, 30001), answer()))
    assert report.verdict == "promote", report.reason


@pytest.mark.parametrize(
    "shadow_info",
    [
        respond(200, [1, 2]),
        respond(200, "a string"),
        respond(200, None),
        respond(404, {"detail": "Not Found"}),
        raw(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n{{{{{"),
        respond(200, b"[" * 100000),
    ],
)
def test_a_server_info_that_cannot_be_read_aborts(shadow_info):
    report = run(routes(info("a"), answer()), routes(shadow_info, answer()))
    assert report.verdict == "abort" and report.checks[0].name == "server_info"
    assert "shadow answered no readable /server_info" in report.reason


@pytest.mark.parametrize(
    "odd",
    [
        {"ddtree_handshake": [1]},
        {"ddtree_handshake": {"budget": "x", "block_size": -1}},
        {"version": ["0.5"], "speculative_algorithm": 5},
    ],
)
def test_odd_server_info_fields_are_ignored_not_a_traceback(odd):
    report = run(routes(info("a"), answer()), routes(info("b", 30001, **odd), answer()))
    assert report.verdict == "promote", report.reason


def test_all_zero_figures_end_in_a_verdict():
    live, shadow = Side("live", "http://a"), Side("shadow", "http://b")
    live.answers = [Answer("p", [1], "x", 0, 4, 0.0)]
    shadow.answers = [Answer("p", [1], "x", 0, 4, 0.0)]
    checks, _ = canary.judge(live, shadow, canary.compare_tokens(live, shadow, 1), Thresholds())
    assert not {c.name: c.ok for c in checks}["accept_length"]


@pytest.mark.parametrize(
    "kw",
    [
        {"ready_timeout": math.nan},
        {"ready_timeout": -1},
        {"ready_timeout": math.inf},
        {"ready_timeout": 0},
        {"request_timeout": 1e9},
        {"request_timeout": math.nan},
        {"rounds": 0},
        {"rounds": 10**9},
        {"max_new_tokens": 0},
        {"max_new_tokens": 10**6},
        {"prompts": [""]},
        {"prompts": ["p"] * 1000},
        {"thresholds": Thresholds(max_latency_ratio=math.nan)},
        {"thresholds": Thresholds(latency_slack_s=math.inf)},
        {"thresholds": Thresholds(min_accept_ratio=math.nan)},
    ],
)
def test_bad_arguments_are_refused_before_any_request(kw):
    with HostileServer(routes(info("a"), answer())) as srv:
        with pytest.raises(CanaryInputError):
            canary.compare(srv.url, srv.url + "0", **{"prompts": ["p"], **kw})
        assert srv.seen == []


def test_cli_bad_timeouts_exit_2_with_a_report():
    for flag, value in (("--ready-timeout", "nan"), ("--request-timeout", "-3")):
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "ddtree_runtime",
                "canary",
                "compare",
                "--live",
                "http://127.0.0.1:1",
                "--shadow",
                "http://127.0.0.1:2",
                flag,
                value,
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 2 and "Traceback" not in res.stderr
        assert flag in json.loads(res.stdout)["reason"]
