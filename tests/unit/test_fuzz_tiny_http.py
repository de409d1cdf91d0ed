"""The lab server's HTTP API against hostile and careless clients, one server for the module.

* Sampling parameters: seeded random bodies with hostile values (NaN, Infinity, 1e-40, 2.5 where an
  integer belongs, 10**30, strings, nulls, lists, unknown fields) are judged by SGLang 0.5.23's own
  code (its JSON contract and SamplingParams.verify) and the lab must agree: a 400 with SGLang's words
  where SGLang refuses, an answer where SGLang answers (or a 400 naming a feature the lab lacks).
* The HTTP layer: broken Content-Length, chunked bodies, non-UTF-8, deep nesting, giant numbers, lone
  surrogates, unknown methods, garbage request lines: always an HTTP answer (4xx), never a dead server.
* Load: a few hundred clients at once on loopback, none refused or reset.
* SIGTERM with a client stalled mid-body: the in-flight generation is answered in full and the server
  exits 0 at once (the last test: it ends the module's server).
"""

from __future__ import annotations

import json
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit._tiny_engine import http
from tests.unit._tiny_server import TinyServerProcess

CONTEXT = 4096
PROMPT = "the cat"


@pytest.fixture(scope="module")
def server(models: Path, tmp_path_factory) -> Iterator[TinyServerProcess]:
    srv = TinyServerProcess(
        ["--model-path", str(models / "target"), "--speculative-algorithm", "DDTREE",
         "--speculative-draft-model-path", str(models / "draft"), "--device", "cpu",
         "--context-length", str(CONTEXT), "--max-running-requests", "64", "--host", "127.0.0.1"],
        tmp=tmp_path_factory.mktemp("fuzz-serve"))  # fmt: skip
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def exchange(port: int, data: bytes, *, timeout: float = 20,
             half_close: bool = False) -> tuple[int | None, bytes]:
    """Send raw bytes, read one HTTP answer: (status, body); (None, b"") when the server closed silently."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                return None, buf
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
        return status, body


def post(path: str, body: bytes, *, headers: str | None = None) -> bytes:
    if headers is None:
        headers = f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return f"POST {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode() + body


def _error_text(body: bytes) -> str:
    doc = json.loads(body)
    error = doc.get("error", doc.get("message"))
    return error if isinstance(error, str) else error["message"]


def _still_serving(srv: TinyServerProcess) -> None:
    assert srv.proc.poll() is None, srv.log[-3000:]
    status, _ = http(srv.url + "/health", timeout=10)
    assert status == 200


# ---------------------------------------------------------------------------- sampling params vs SGLang

HOSTILE = [float("nan"), float("inf"), -float("inf"), 1e-40, 1e-7, 1e300, -1, 0, 1, 2.5, 1e30, 10**30,
           -(10**30), "1", "", True, None, [], [1], {}, {"a": 1}, 0.5, 2, 3, 50, -2, 10**19]
FIELDS = ["temperature", "top_k", "top_p", "min_p", "max_new_tokens", "min_new_tokens", "frequency_penalty",
          "presence_penalty", "repetition_penalty", "ignore_eos", "stop_token_ids", "n", "stop",
          "skip_special_tokens", "sampling_seed", "json_schema", "max_new_tokenz", "logit_bias"]


def _sampling_case(seed: int) -> dict:
    rng = random.Random(seed)
    sp: dict[str, Any] = {"max_new_tokens": 4, "temperature": 0}
    for field in rng.sample(FIELDS, rng.choice((1, 1, 2, 3))):
        value = rng.choice(HOSTILE)
        if field in ("max_new_tokens", "min_new_tokens") and isinstance(value, int | float) and value > 64:
            value = rng.choice((value, 8))  # keep most generations short
        sp[field] = value
    return {"text": PROMPT, "sampling_params": sp}


def _sglang_verdict(body: dict, vocab: int) -> str | None:
    """SGLang 0.5.23's own answer to this body: None (it generates) or its 400 message."""
    api = pytest.importorskip("sglang.api.v1.api_types")
    sampling = pytest.importorskip("sglang.srt.sampling.sampling_params")
    try:
        api.GenerateRequest.from_json_value(body)
    except api.JsonContractError as exc:
        return str(exc)
    sp = body["sampling_params"]
    try:
        sampling.SamplingParams(**sp).verify(vocab)
    except (ValueError, TypeError, OverflowError) as exc:
        return str(exc)
    if (sp.get("max_new_tokens") or 0) + 8 > CONTEXT:
        return "Requested token count exceeds the model's maximum context length"
    return None


@pytest.mark.parametrize("seed", range(60))
def test_sampling_params_are_judged_as_sglang_judges_them(server: TinyServerProcess, seed: int) -> None:
    from ddtree_runtime.tiny_engine.tokenizer import TinyTokenizer

    body = _sampling_case(seed)
    verdict = _sglang_verdict(body, TinyTokenizer().vocab_size)
    status, answer = exchange(server.port, post("/generate", json.dumps(body).encode()))
    shown = json.dumps(body)[:300]
    if verdict is None:
        if status == 400:  # SGLang generates; the lab may only lack the feature
            assert "not supported by the lab engine" in _error_text(answer), (shown, answer)
        else:
            assert status == 200, (shown, status, answer[:500])
            assert json.loads(answer)["meta_info"]["completion_tokens"] <= max(body["sampling_params"].get(
                "max_new_tokens") or 128, 0)
    else:
        assert status == 400, (shown, verdict, status, answer[:500])
        message = _error_text(answer)
        if "context length" in verdict:
            assert "maximum context length" in message
        elif "expected one of" not in verdict and "huge" not in message:
            assert message == verdict, (shown, message, verdict)
    if seed % 10 == 9:
        _still_serving(server)


def test_tiny_temperature_is_greedy_and_hostile_values_do_not_kill(server: TinyServerProcess) -> None:
    def gen(sp: dict) -> tuple[int, Any]:
        status, body = exchange(server.port, post("/generate", json.dumps(
            {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, **sp}}).encode()))
        return status, json.loads(body)

    greedy = gen({"temperature": 0})
    assert greedy[0] == 200
    tiny = gen({"temperature": 1e-40})
    assert tiny[0] == 200 and tiny[1]["output_ids"] == greedy[1]["output_ids"]  # < 1e-6 is greedy
    nan_words = "temperature must be a non-negative finite number, got nan."
    for sp, words in (({"temperature": float("nan")}, nan_words),
                      ({"top_k": 2.5}, "invalid type: floating point `2.5`, expected i64"),
                      ({"top_k": 1e30}, "invalid type: floating point `1e+30`, expected i64"),
                      ({"top_p": 0}, "top_p must be in (0, 1], got 0.")):
        status, doc = gen(sp)
        assert status == 400 and words in json.dumps(doc), (sp, doc)
    status, doc = gen({"top_k": 10**30, "temperature": 0.7})  # SGLang: the whole vocabulary
    assert status == 200 and doc["meta_info"]["completion_tokens"] == 12
    _still_serving(server)


# ---------------------------------------------------------------------------- the HTTP layer

GOOD = json.dumps({"text": PROMPT, "sampling_params": {"max_new_tokens": 2}}).encode()
RAW_CASES: dict[str, tuple[bytes, set[int | None]]] = {
    "not UTF-8": (post("/generate", b'{"text": "\xff\xfe"}'), {400}),
    "lone surrogate": (post("/generate", b'{"text": "a\\ud800b"}'), {400}),
    "nested 100k": (post("/generate", b"[" * 100_000 + b"]" * 100_000), {400}),
    "5000-digit int": (post("/generate", b'{"input_ids": [' + b"9" * 5000 + b"]}"), {400}),
    "huge ids": (post("/generate", b'{"input_ids": [1e30, 2.5]}'), {400}),
    "top-level list": (post("/generate", b"[1, 2]"), {400}),
    "empty body": (post("/generate", b""), {400}),
    "NaN literal": (post("/generate", b'{"text": "a", "sampling_params": {"temperature": NaN}}'), {400}),
    "text a number": (post("/generate", b'{"text": 5}'), {400}),
    "ids and text": (post("/generate", b'{"text": "a", "input_ids": [1]}'), {400}),
    "stream a string": (post("/generate", b'{"text": "a", "stream": "yes"}'), {400}),
    "sampling_params a list too short": (post("/generate", b'{"text": ["a", "b"], "sampling_params": [{}]}'),
                                         {400}),
    "Content-Length abc": (post("/generate", GOOD, headers="Content-Length: abc\r\n"), {400}),
    "Content-Length negative": (post("/generate", GOOD, headers="Content-Length: -5\r\n"), {400}),
    "Content-Length 10**12": (post("/generate", GOOD, headers="Content-Length: 1000000000000\r\n"), {413}),
    "two Content-Lengths": (post("/generate", GOOD, headers=f"Content-Length: {len(GOOD)}\r\n"
                                 "Content-Length: 3\r\n"), {400}),
    "chunked": (post("/generate", b"%x\r\n%s\r\n0\r\n\r\n" % (len(GOOD), GOOD),
                     headers="Transfer-Encoding: chunked\r\n"), {200}),
    "chunked broken": (post("/generate", b"zz\r\nabc\r\n", headers="Transfer-Encoding: chunked\r\n"), {400}),
    "gzip encoding": (post("/generate", GOOD, headers="Transfer-Encoding: gzip\r\n"), {400}),
    "body shorter than said": (post("/generate", GOOD, headers=f"Content-Length: {len(GOOD) + 10}\r\n"),
                               {None}),
    "unknown path": (post("/nope", GOOD), {404}),
    "DELETE": (b"DELETE /generate HTTP/1.1\r\nHost: x\r\n\r\n", {405}),
    "TLS hello": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(200)) + b"\r\n\r\n",
                             {400, None}),
    "HTTP/2 preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", {400, 505, None}),
    "header too long": (b"GET /health HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", {400, 431, None}),
    "chat roles wrong": (post("/v1/chat/completions", b'{"messages": [{"role": "root", "content": "x"}]}'),
                         {400}),
    "chat n a string": (post("/v1/chat/completions",
                             b'{"messages": [{"role": "user", "content": "x"}], "n": "two"}'), {400}),
    "completions temperature NaN": (post("/v1/completions", b'{"prompt": "a", "temperature": NaN}'), {400}),
    "completions max_tokens 2.5": (post("/v1/completions", b'{"prompt": "a", "max_tokens": 2.5}'), {400}),
}


@pytest.mark.parametrize("name", sorted(RAW_CASES))
def test_hostile_requests_get_an_http_answer(server: TinyServerProcess, name: str) -> None:
    data, allowed = RAW_CASES[name]
    started = time.monotonic()
    status, body = exchange(server.port, data, half_close=name == "body shorter than said")
    assert time.monotonic() - started < 15
    assert status in allowed, (name, status, body[:300])
    if status is not None and status >= 400 and body:
        assert _error_text(body)  # a JSON error that says something
    _still_serving(server)


def test_no_handler_ever_crashed(server: TinyServerProcess) -> None:
    """Every case above was answered by design, not by the last-resort 500."""
    assert "Exception in the HTTP handler" not in server.log and "Traceback" not in server.log


# ---------------------------------------------------------------------------- load

CLIENTS = 300


def test_a_few_hundred_clients_at_once_are_all_answered(server: TinyServerProcess) -> None:
    barrier, results = threading.Barrier(CLIENTS), [None] * CLIENTS
    body = json.dumps({"text": PROMPT, "sampling_params": {"max_new_tokens": 1}}).encode()

    def client(i: int) -> None:
        barrier.wait()
        try:
            data = post("/generate", body) if i % 3 else b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
            results[i] = exchange(server.port, data, timeout=60)[0]
        except OSError as exc:
            results[i] = repr(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    lost = [r for r in results if r != 200]
    took = round(time.monotonic() - started, 2)
    print(json.dumps({"clients": CLIENTS, "lost": len(lost), "seconds": took}))
    assert not lost, lost[:10]


# ---------------------------------------------------------------------------- drain (ends the server)


def test_sigterm_drains_despite_a_client_stalled_mid_body(server: TinyServerProcess) -> None:
    stalled = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    stalled.sendall(b'POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{"text": "the')
    got: dict = {}
    long = json.dumps({"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 120}}).encode()
    t = threading.Thread(target=lambda: got.update(answer=exchange(server.port, post("/generate", long))))
    before = server.log.count("Prefill batch")
    t.start()
    deadline = time.monotonic() + 30
    while server.log.count("Prefill batch") == before and time.monotonic() < deadline:
        time.sleep(0.01)
    server.proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    try:
        assert server.wait_exit(30) == 0, server.log[-2000:]
    finally:
        stalled.close()
    t.join(30)
    assert time.monotonic() - started < 20
    status, body = got["answer"]
    assert status == 200 and json.loads(body)["meta_info"]["completion_tokens"] == 120
    assert "Received SIGTERM" in server.log


def test_an_omitted_temperature_is_sglangs_default() -> None:
    """A request that names no temperature samples, as SGLang's SamplingParams() does."""
    sampling = pytest.importorskip("sglang.srt.sampling.sampling_params")
    from ddtree_runtime.tiny_engine.sglang_requests import sampling_params
    from ddtree_runtime.tiny_engine.tokenizer import TinyTokenizer

    vocab = TinyTokenizer().vocab_size
    default = sampling.SamplingParams().temperature
    assert sampling_params({}, vocab)["temperature"] == default > 0
    assert sampling_params({"temperature": None}, vocab)["temperature"] == default
    assert sampling_params({"temperature": 1e-7}, vocab)["temperature"] == 0.0  # below SGLang's eps: greedy
