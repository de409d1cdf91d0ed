"""The server benchmark's client against a loopback server that streams /generate as SGLang does
(``data: {...}`` chunks, cumulative ``output_ids`` and ``meta_info``, then ``data: [DONE]``)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ddtree_runtime.health.server_bench import bench_server, run_level, summarize

TOKENS, STEPS, FIRST_CHUNK_DELAY = 12, 4, 0.05


class Streamer(BaseHTTPRequestHandler):
    in_flight = 0
    peak = 0
    lock = threading.Lock()
    fail = False

    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if Streamer.fail:
            self.send_response(500)
            self.end_headers()
            return
        with Streamer.lock:
            Streamer.in_flight += 1
            Streamer.peak = max(Streamer.peak, Streamer.in_flight)
        counted = True
        try:
            n = body["sampling_params"]["max_new_tokens"]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            time.sleep(FIRST_CHUNK_DELAY)
            seed = len(body["text"])
            for i in range(1, n + 1):
                chunk = {
                    "text": "x" * i,
                    "output_ids": [seed + j for j in range(i)],
                    "meta_info": {"completion_tokens": i, "spec_verify_ct": -(-i * STEPS // n)},
                }
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            # Done before [DONE] is sent: the client may send its next request as soon as it reads it.
            with Streamer.lock:
                Streamer.in_flight -= 1
            counted = False
            self.wfile.write(b"data: [DONE]\n\n")
        finally:
            if counted:
                with Streamer.lock:
                    Streamer.in_flight -= 1


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Streamer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    Streamer.peak, Streamer.fail = 0, False
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_a_level_keeps_its_concurrency_and_reads_tokens_steps_and_first_chunk_time(server):
    results, wall = run_level(server, ["ab", "abcd"], concurrency=3, requests=6, max_new_tokens=TOKENS)
    assert Streamer.peak == 3
    assert [r.prompt_index for r in results] == [0, 1, 0, 1, 0, 1]
    assert all(r.completion_tokens == TOKENS and r.verify_steps == STEPS for r in results)
    assert results[1].output_ids == list(range(4, 4 + TOKENS))  # the last chunk's cumulative ids
    assert all(FIRST_CHUNK_DELAY <= r.ttft_s <= r.e2e_s for r in results)
    row = summarize(results, wall)
    assert row["tokens"] == 6 * TOKENS and row["accept_length"] == TOKENS / STEPS
    assert row["output_tokens_per_s"] == pytest.approx(6 * TOKENS / wall, rel=0.01)


def test_the_summary_takes_medians_over_repeats_and_keeps_the_ids(server):
    lines = []
    summary = bench_server(server, ["ab"], levels=[1, 2], repeats=3, max_new_tokens=TOKENS, emit=lines.append)
    measured = [json.loads(x) for x in lines if json.loads(x)["bench"] == "server"]
    assert len(measured) == 6 and {x["concurrency"] for x in measured} == {1, 2}
    assert summary[2]["requests"] == 4 and len(summary[2]["ids"]) == 4  # 2 x concurrency, every prompt once
    assert summary[1]["accept_length"] == TOKENS / STEPS


def test_a_failing_server_fails_the_level_with_the_cause(server):
    Streamer.fail = True
    with pytest.raises(RuntimeError, match="request\\(s\\) failed at concurrency 2"):
        run_level(server, ["ab"], concurrency=2, requests=4, max_new_tokens=4)


@pytest.mark.parametrize(("concurrency", "requests"), [(0, 4), (300, 4), (2, 0)])
def test_absurd_levels_are_refused(concurrency, requests):
    with pytest.raises(ValueError, match="choose"):
        run_level("http://127.0.0.1:9", ["a"], concurrency=concurrency, requests=requests, max_new_tokens=4)


def test_each_level_runs_once_unmeasured_before_its_repeats(server, monkeypatch):
    """A server compiles kernels at each new batch size: the first pass of a level is a warm-up, named
    as such, and the medians come from the repeats after it."""
    import ddtree_runtime.health.server_bench as sb

    calls = []
    real = sb.run_level
    monkeypatch.setattr(sb, "run_level", lambda *a, **kw: calls.append(kw["concurrency"]) or real(*a, **kw))
    lines = []
    bench_server(server, ["ab"], levels=[1, 2], repeats=2, max_new_tokens=TOKENS, emit=lines.append)
    kinds = [(json.loads(x)["bench"], json.loads(x)["concurrency"]) for x in lines]
    assert kinds == [("server_warmup", 1), ("server", 1), ("server", 1),
                     ("server_warmup", 2), ("server", 2), ("server", 2)]  # fmt: skip
    assert calls == [1, 1, 1, 1, 2, 2, 2]  # the one-request warm-up, then each level 1 + 2 times

    calls.clear()
    lines.clear()
    bench_server(server, ["ab"], levels=[2], repeats=2, max_new_tokens=TOKENS, emit=lines.append,
                 warm_each_level=False)  # fmt: skip
    assert [json.loads(x)["bench"] for x in lines] == ["server", "server"] and calls == [1, 2, 2]


def test_phases_run_back_to_back_and_count_every_token_over_the_whole_wall_time(server):
    from ddtree_runtime.health.server_bench import bench_phases

    lines: list[str] = []
    out = bench_phases(server, ["ab", "abc"], phases=[1, 4, 1], repeats=2, max_new_tokens=TOKENS,
                       emit=lines.append)  # fmt: skip
    runs = [json.loads(x) for x in lines]
    assert [r["repeat"] for r in runs] == [0, 1] and all(r["phases"] == [1, 4, 1] for r in runs)
    # 2 + 8 + 2 requests of TOKENS tokens each repeat, over the phases' summed wall time
    assert all(r["tokens"] == 12 * TOKENS for r in runs)
    assert all(r["output_tokens_per_s"] == pytest.approx(r["tokens"] / r["wall_s"], rel=1e-3) for r in runs)
    assert len(out["phase_tokens_per_s"]) == 3 and len(out["ids"]) == 3 and len(out["ids"][1]) == 8
    assert Streamer.peak == 4  # the middle phase really ran four at a time
    with pytest.raises(ValueError, match="at least one concurrency"):
        bench_phases(server, ["ab"], phases=[])
