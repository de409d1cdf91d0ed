"""`ddtree probe live` against misbehaving servers on loopback (tests/unit/hostile_http.py).

Every endpoint the probe uses is broken in turn, at the transport (garbage, resets, drips, hangs,
endless bodies, a death between two requests) and in the JSON (wrong types, NaN and Infinity, absurd
counts, acceptance lengths outside 1..block size), then seeded random pairs of defects. The outcome
class is asserted: never "ok" for a broken server, a named cause with its documented exit code, strict
JSON in the report, and an end within the deadlines however the server behaves.
"""

from __future__ import annotations

import copy
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ddtree_runtime.health.probe_live import live_probe
from ddtree_runtime.health.probe_report import EXIT_FAILED, EXIT_NOT_READY, EXIT_PASS
from tests.unit.fake_sglang import SERVER_INFO
from tests.unit.hostile_http import HostileServer, close, drip, endless, hang, raw, reset, respond

TIMEOUT, REQUEST_TIMEOUT = 1.0, 0.5
# One prompt: /health_generate, /tokenize, /generate alone and with the others (at once), the lossless
# check of both answers, /server_info and maybe /metrics, each within its deadline.
BOUND_S = TIMEOUT + 7 * REQUEST_TIMEOUT + 1.5
PASS = "PASS"


def _generate_doc(**meta: Any) -> dict:
    m = {"id": "x", "finish_reason": {"type": "length", "length": 32}, "prompt_tokens": 6,
         "completion_tokens": 32, "spec_verify_ct": 8, "cached_tokens": 0}
    for k, v in meta.items():
        if v is _DROP:
            m.pop(k, None)
        else:
            m[k] = v
    return {"text": " Paris. It is the capital.", "output_ids": list(range(32)), "meta_info": m}


_DROP = object()


class Case:
    """The routes of one server, built from the healthy ones, plus the causes a probe may name."""

    def __init__(self) -> None:
        self.generate = _generate_doc()
        self.info = copy.deepcopy(SERVER_INFO)
        self.metrics: str | None = None
        self.overrides: dict[str, Any] = {}
        self.die_after: int | None = None
        self.causes: set[str] = set()
        self.names: list[str] = []

    def routes(self) -> dict:
        r = {"/health_generate": respond(200, ""), "/generate": respond(200, self.generate),
             "/server_info": respond(200, self.info)}
        if self.metrics is not None:
            r["/metrics"] = respond(200, self.metrics, "text/plain; version=0.0.4")
        r.update(self.overrides)
        return r


def _transport(path: str, behaviour: Any, causes: set[str]):
    def apply(c: Case) -> None:
        c.overrides[path] = behaviour
        if path == "/metrics":  # only asked when neither meta nor server state report acceptance
            c.generate["meta_info"].pop("spec_verify_ct")
            c.info["internal_states"] = []
        c.causes |= causes
    return apply


def _meta(causes: set[str] | str, **meta: Any):
    def apply(c: Case) -> None:
        c.generate = _generate_doc(**{**{k: v for k, v in c.generate["meta_info"].items()}, **meta})
        c.causes |= {causes} if isinstance(causes, str) else causes
    return apply


def _doc(causes: set[str] | str, **fields: Any):
    def apply(c: Case) -> None:
        c.generate.update(fields)
        c.causes |= {causes} if isinstance(causes, str) else causes
    return apply


def _info(causes: set[str] | str, path: tuple[str, ...], value: Any, *, from_state: bool = False):
    def apply(c: Case) -> None:
        target = c.info
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        if from_state:  # acceptance from server state: no per-request spec counts
            c.generate["meta_info"].pop("spec_verify_ct", None)
        c.causes |= {causes} if isinstance(causes, str) else causes
    return apply


def _raw_info(causes: set[str], body: bytes):
    return _transport("/server_info", respond(200, body), causes)


def _metrics(causes: set[str] | str, text: str):
    def apply(c: Case) -> None:
        c.generate["meta_info"].pop("spec_verify_ct", None)
        c.info["internal_states"] = []
        c.metrics = text
        c.causes |= {causes} if isinstance(causes, str) else causes
    return apply


def _dies_after(requests: int, causes: set[str]):
    def apply(c: Case) -> None:
        c.die_after = requests
        c.causes |= causes
    return apply


SSH = raw(b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n")
BINARY = raw(bytes(random.Random(7).randrange(256) for _ in range(300)))
LIAR = raw(b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n{\"text\": ")  # then closes
BAD_STATUS = raw(b"HTTP/1.1 abc Broken\r\n\r\n")
NESTED = b"[" * 100_000 + b"]" * 100_000
HUGE_INT = b'{"version": ' + b"9" * 5000 + b"}"
READY = {"not_ready", "not_http"}  # exit 3
GEN = {"connection_lost", "request_timeout", "bad_response", "generation_failed"}
INFO = {"connection_lost", "request_timeout", "bad_response", "server_info_unavailable"}

DEFECTS: dict[str, Any] = {
    # transport, per endpoint
    "health: SSH banner": _transport("/health_generate", SSH, READY),
    "health: binary noise": _transport("/health_generate", BINARY, READY),
    "health: hangs up": _transport("/health_generate", close, READY),
    "health: resets": _transport("/health_generate", reset, READY),
    "health: drips": _transport("/health_generate", drip(respond(200, "")), READY),
    "health: hangs": _transport("/health_generate", hang, READY),
    "health: 503 for ever": _transport("/health_generate", respond(503, ""), READY),
    "generate: SSH banner": _transport("/generate", SSH, GEN),
    "generate: hangs up": _transport("/generate", close, GEN),
    "generate: resets": _transport("/generate", reset, GEN),
    "generate: drips": _transport("/generate", drip(respond(200, _generate_doc()), 0.02), GEN),
    "generate: hangs": _transport("/generate", hang, GEN),
    "generate: endless body": _transport("/generate", endless, GEN),
    "generate: lies about its length": _transport("/generate", LIAR, GEN),
    "generate: bad status line": _transport("/generate", BAD_STATUS, GEN),
    "generate: 500": _transport("/generate", respond(500, {"error": {"message": "boom"}}), GEN),
    "generate: 200 not JSON": _transport("/generate", respond(200, b"<html>hi</html>"), GEN),
    "generate: 200 nested": _transport("/generate", respond(200, NESTED), GEN),
    "server_info: SSH banner": _transport("/server_info", SSH, INFO),
    "server_info: hangs": _transport("/server_info", hang, INFO),
    "server_info: drips": _transport("/server_info", drip(respond(200, SERVER_INFO), 0.01), INFO),
    "server_info: endless": _transport("/server_info", endless, INFO),
    "server_info: 404": _transport("/server_info", respond(404, {"detail": "Not Found"}), INFO),
    "server_info: a list": _raw_info(INFO, b"[1, 2]"),
    "server_info: nested": _raw_info(INFO, NESTED),
    "server_info: 5000-digit int": _raw_info(INFO, HUGE_INT),
    # the lossless check's endpoints: /tokenize, then the batched check request on /generate
    "tokenize: hangs": _transport("/tokenize", hang, {"request_timeout"}),
    "tokenize: SSH banner": _transport("/tokenize", SSH, {"bad_response"}),
    "tokenize: resets": _transport("/tokenize", reset, {"connection_lost"}),
    # a server with /tokenize whose check fails: failed with its own cause, never not_checked
    "check: one object for a batch": _transport(
        "/tokenize", respond(200, {"tokens": [[1, 2, 3]], "count": [3]}), {"lossless_check_error"}),
    "tokenize: 500": _transport("/tokenize", respond(500, {"error": "boom"}), {"lossless_check_error"}),
    "tokenize: junk tokens": _transport("/tokenize", respond(200, {"tokens": "abc"}),
                                        {"lossless_check_error"}),
    "metrics: hangs": _transport("/metrics", hang, {"acceptance_low"}),
    "metrics: garbage": _transport("/metrics", BINARY, {"acceptance_low"}),
    "dies after the health check": _dies_after(1, GEN),
    "dies after the generation": _dies_after(2, INFO),
    # wrongly typed or impossible generation answers
    "completion_tokens a string": _meta("bad_response", completion_tokens="32"),
    "completion_tokens negative": _meta("bad_response", completion_tokens=-5),
    "completion_tokens a float": _meta("bad_response", completion_tokens=1.5),
    "completion_tokens true": _meta("bad_response", completion_tokens=True),
    "completion_tokens 10**13": _meta("bad_response", completion_tokens=10**13),
    "spec_verify_ct a list": _meta("bad_response", spec_verify_ct=[8]),
    "spec_verify_ct an object": _meta("bad_response", spec_verify_ct={"n": 8}),
    "meta_info a list": _doc("bad_response", meta_info=[1]),
    "meta_info a string": _doc("bad_response", meta_info="meta"),
    "text null": _doc("bad_response", text=None),
    "text a number": _doc("bad_response", text=5),
    "text blank": _doc("empty_answer", text="   "),
    # completion_tokens against the 32 output_ids: the count check names it first
    "accept 0 (no tokens)": _meta({"accept_length_invalid", "wrong_token_count"}, completion_tokens=0),
    "accept 0.5 (more steps than tokens)": _meta({"accept_length_invalid", "wrong_token_count"},
                                                 completion_tokens=4),
    "accept 1e6": _meta({"accept_length_invalid", "wrong_token_count"}, completion_tokens=10**6,
                        spec_verify_ct=1),
    "accept 18 > block + 1": _meta({"accept_length_invalid", "wrong_token_count"}, completion_tokens=18,
                                   spec_verify_ct=1),
    "fewer tokens than asked": _doc("wrong_token_count", output_ids=list(range(30))),
    "more tokens than asked": _doc("wrong_token_count", output_ids=list(range(34))),
    # wrongly typed or impossible server state
    "state accept 0": _info("accept_length_invalid", ("internal_states", 0, "avg_spec_accept_length"), 0,
                            from_state=True),
    "state accept negative": _info("accept_length_invalid", ("internal_states", 0, "avg_spec_accept_length"),
                                   -2.5, from_state=True),
    "state accept NaN": _info("accept_length_invalid", ("internal_states", 0, "avg_spec_accept_length"),
                              float("nan"), from_state=True),
    "state accept Infinity": _info("accept_length_invalid", ("internal_states", 0, "avg_spec_accept_length"),
                                   float("inf"), from_state=True),
    "state accept 1e6": _info("accept_length_invalid", ("internal_states", 0, "avg_spec_accept_length"),
                              1e6, from_state=True),
    "state accept 17": _info("accept_length_invalid", ("internal_states", 0, "avg_spec_accept_length"),
                             17.0, from_state=True),
    "state accept a string": _info("bad_response", ("internal_states", 0, "avg_spec_accept_length"), "3.5",
                                   from_state=True),
    "internal_states a number": _info("bad_response", ("internal_states",), 5, from_state=True),
    "internal_states junk items": _info("acceptance_low", ("internal_states",), [5, "x", None],
                                        from_state=True),
    "handshake widths as strings": _info("bad_response", ("ddtree_handshake",),
                                         {**SERVER_INFO["ddtree_handshake"], "expected_hidden_width": "25600",
                                          "observed_hidden_width": "25600", "draft_fc_in_features": "25600"}),
    "handshake observed a string": _info("hidden_width_mismatch",
                                         ("ddtree_handshake", "observed_hidden_width"), "25600"),
    "handshake observed NaN": _info("hidden_width_mismatch",
                                    ("ddtree_handshake", "observed_hidden_width"), float("nan")),
    "handshake observed true": _info("hidden_width_mismatch",
                                     ("ddtree_handshake", "observed_hidden_width"), True),
    "handshake status OK": _info("handshake_pending", ("ddtree_handshake", "status"), "OK"),
    "handshake status null": _info("handshake_pending", ("ddtree_handshake", "status"), None),
    "handshake a list": _info("plugin_not_registered", ("ddtree_handshake",), [1, 2]),
    "algorithm a number": _info("flags_mismatch", ("speculative_algorithm",), 5),
    "algorithm null": _info("flags_mismatch", ("speculative_algorithm",), None),
    # /metrics as the last source
    "metrics NaN": _metrics("accept_length_invalid", "sglang:spec_accept_length NaN\n"),
    "metrics +Inf": _metrics("accept_length_invalid", 'sglang:spec_accept_length{model_name="q"} +Inf\n'),
    "metrics 1e6": _metrics("accept_length_invalid", "sglang:spec_accept_length 1e6\n"),
    "metrics no number": _metrics("bad_response", "sglang:spec_accept_length abc\n"),
    "metrics labels unclosed": _metrics("bad_response", 'sglang:spec_accept_length{model_name="q" 2.0\n'),
    "metrics empty value": _metrics("bad_response", "sglang:spec_accept_length \n"),
}

# Odd but legitimate answers: the probe must still pass.
HARMLESS: dict[str, Any] = {
    "output_ids not a list": _doc(PASS, output_ids="abc"),
    "meta_info missing spec counts, state has them": _meta(PASS, spec_verify_ct=_DROP),
    "version an object": _info(PASS, ("version",), {"deep": [[[1]]]}),
    "handshake block_size a string": _info(PASS, ("ddtree_handshake", "block_size"), "16"),
    "extra handshake field": _info(PASS, ("ddtree_handshake", "hybrid"), True),
    "metrics with junk lines and a timestamp": _metrics(
        PASS, "garbage {{{\nsglang:spec_accept_length_bucket 99\n"
              'sglang:spec_accept_length{a="}"} 2.5 1700000000\n'),
}

SEEDS = range(len(DEFECTS) + len(HARMLESS) + 16)


def _case(seed: int) -> Case:
    """Seed i plants defect i, then each harmless oddity, then seeded random pairs of defects."""
    case, names = Case(), sorted(DEFECTS)
    if seed < len(names):
        chosen = [names[seed]]
    elif seed < len(names) + len(HARMLESS):
        name = sorted(HARMLESS)[seed - len(names)]
        HARMLESS[name](case)
        case.names = [name]
        return case
    else:
        chosen = random.Random(seed).sample(names, 2)
    for name in chosen:
        DEFECTS[name](case)
    case.names = chosen
    return case


def _exit_codes(causes: set[str]) -> set[int]:
    return {EXIT_NOT_READY if c in READY else EXIT_FAILED for c in causes}


@pytest.mark.parametrize("seed", SEEDS)
def test_live_probe_against_a_misbehaving_server(seed: int) -> None:
    case = _case(seed)
    with HostileServer(case.routes(), die_after=case.die_after) as srv:
        started = time.monotonic()
        # The hostile server has no /tokenize (404): without the fields, allowed here (tested elsewhere).
        report = live_probe(srv.url, timeout=TIMEOUT, request_timeout=REQUEST_TIMEOUT, poll_s=0.05,
                            prompts=["The capital of France is"], min_accept_length=1.5,
                            allow_lossless_unchecked=True)
        took = time.monotonic() - started
    assert took < BOUND_S, f"{case.names}: {took:.1f} s"
    doc = report.to_dict()
    json.dumps(doc, allow_nan=False)  # strict JSON whatever the server sent
    if case.causes == {PASS}:
        assert report.ok and report.exit_code == EXIT_PASS, (case.names, report.message)
        return
    assert not report.ok, f"{case.names}: a broken server passed: {report.message}"
    # a pair of defects: the first one the probe meets names the failure
    assert report.cause in case.causes - {PASS}, (case.names, report.cause, report.message)
    assert report.exit_code in _exit_codes({report.cause}), (case.names, report.exit_code)
    assert "\n" not in report.message and len(report.message) < 3000, report.message


@pytest.mark.parametrize("name", ["health: SSH banner", "generate: drips", "state accept NaN",
                                  "dies after the generation", "metrics +Inf"])
def test_cli_exit_code_and_strict_json_report(name: str, tmp_path: Path) -> None:
    case = Case()
    DEFECTS[name](case)
    out = tmp_path / "probe" / "sglang-qwen.json"
    with HostileServer(case.routes(), die_after=case.die_after) as srv:
        res = subprocess.run([sys.executable, "-m", "ddtree_runtime", "probe", "live", "--url", srv.url,
                              "--timeout", str(TIMEOUT), "--request-timeout", str(REQUEST_TIMEOUT),
                              "--prompts", "hello", "--min-accept-length", "1.5", "--json",
                              "--allow-lossless-unchecked",
                              "--write-report", str(out)], capture_output=True, text=True, timeout=30)
    assert "Traceback" not in res.stderr, res.stderr
    text = out.read_text()
    assert "NaN" not in text and "Infinity" not in text
    doc = json.loads(text)
    assert json.loads(res.stdout) == doc and not doc["ok"]
    assert doc["cause"] in case.causes and res.returncode == doc["exit_code"] in _exit_codes({doc["cause"]})
    assert [p.name for p in out.parent.iterdir()] == ["sglang-qwen.json"]  # no temp file left


@pytest.mark.parametrize("args", [
    ["--timeout", "nan"], ["--timeout", "inf"], ["--timeout", "-1"], ["--timeout", "0"],
    ["--request-timeout", "nan"], ["--request-timeout", "1e30"], ["--max-new-tokens", "0"],
    ["--max-new-tokens", "-3"], ["--min-accept-length", "nan"], ["--min-accept-length", "inf"],
    ["--min-accept-length", "0.5"], ["--prompts", ""], ["--prompts", "   "],
    ["--url", "http://127.0.0.1:99999"], ["--url", "http://[::1"], ["--url", "http://"],
    ["--url", "ftp://127.0.0.1:30000"], ["--url", "http://127.0.0.1:30000/x?y=1"],
    ["--url", "http://exa mple:30000"], ["--url", "http://127.0.0.1:0"], ["--unit", "../../etc/passwd"],
])
def test_bad_arguments_are_exit_2_at_once(args: list[str]) -> None:
    full = ["--url", "http://127.0.0.1:9", *args] if args[0] != "--url" else args
    started = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "ddtree_runtime", "probe", "live", *full, "--json"],
                         capture_output=True, text=True, timeout=30)
    assert time.monotonic() - started < 10
    assert res.returncode == 2, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["cause"] == "bad_input" and "\n" not in doc["message"] and "Traceback" not in res.stderr


@pytest.mark.parametrize("name", ["completion_tokens a string", "meta_info a list", "generate: SSH banner",
                                  "generate: drips"])
def test_canary_compare_names_a_misbehaving_shadow(name: str) -> None:
    """`ddtree canary compare` reads the same answers: a broken shadow aborts the canary, in one line."""
    from ddtree_runtime.health.canary import compare

    healthy, broken = Case(), Case()
    DEFECTS[name](broken)
    # Two servers, as each reports itself (the canary aborts on two it cannot tell apart).
    healthy.info["ddtree_instance_id"], broken.info["ddtree_instance_id"] = "live", "shadow"
    with HostileServer(healthy.routes()) as live, HostileServer(broken.routes()) as shadow:
        started = time.monotonic()
        report = compare(live.url, shadow.url, prompts=["a"], rounds=1, ready_timeout=TIMEOUT,
                         request_timeout=REQUEST_TIMEOUT)
    assert time.monotonic() - started < BOUND_S
    assert (report.ok, report.verdict, report.exit_code) == (False, "abort", EXIT_FAILED)
    assert report.reason.startswith("generate: shadow:") and "\n" not in report.reason
