"""`ddtree tiny-engine serve`: SGLang's flags, endpoints, response shapes, metrics, logs, batching, SIGTERM
drain, and the faults dying the way SGLang dies."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddtree_runtime.cli import build_parser
from ddtree_runtime.health import diagnose
from ddtree_runtime.tiny_engine.engine import SamplingParams, TinyEngine
from ddtree_runtime.tiny_engine.language import LAB_PROMPTS
from ddtree_runtime.tiny_engine.server_args import memory_plan
from ddtree_runtime.tiny_engine.tokenizer import TinyTokenizer
from tests.unit._tiny_engine import http, one_thread
from tests.unit._tiny_server import TinyServerProcess

pytestmark = pytest.mark.usefixtures("tiny_one_thread")


def _args(models: Path, *extra: str, algo: str = "DDTREE", draft: str = "draft") -> list[str]:
    return [
        "--model-path", str(models / "target"),
        "--speculative-algorithm", algo,
        "--speculative-draft-model-path", str(models / draft),
        "--device", "cpu",
        *extra,
    ]  # fmt: skip


# The balanced profile's flags, as the unit template renders them.
PROFILE = [
    "--mem-fraction-static", "0.85", "--context-length", "32768", "--cuda-graph-max-bs-decode", "32",
    "--max-running-requests", "32", "--mamba-radix-cache-strategy", "extra_buffer",
    "--mamba-ssm-dtype", "float32", "--max-mamba-cache-size", "64", "--speculative-ddtree-budget", "16",
    "--enable-metrics", "--host", "127.0.0.1",
]  # fmt: skip


@pytest.fixture(scope="module")
def server(models: Path, tmp_path_factory) -> Iterator[TinyServerProcess]:
    srv = TinyServerProcess(_args(models, *PROFILE), tmp=tmp_path_factory.mktemp("serve"))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def expected(models: Path) -> dict[str, list[int]]:
    """AR greedy of the lab prompts, in process: the server's DDTree answers must equal these."""
    with one_thread():
        engine = TinyEngine(models / "target")
        out = engine.generate(
            [engine.tokenizer.encode(p) for p in LAB_PROMPTS], [SamplingParams(max_new_tokens=24)] * 6
        )
    return {p: r.output_ids for p, r in zip(LAB_PROMPTS, out, strict=True)}


def _json(resp: tuple[int, bytes]) -> tuple[int, object]:
    return resp[0], json.loads(resp[1]) if resp[1] else None


def test_health_and_info(server: TinyServerProcess) -> None:
    assert http(server.url + "/health")[0] == 200
    assert http(server.url + "/health_generate")[0] == 200
    status, info = _json(http(server.url + "/server_info"))
    assert status == 200 and info == _json(http(server.url + "/get_server_info"))[1] | {
        "internal_states": info["internal_states"],
        "ddtree_handshake": info["ddtree_handshake"],
    }
    assert info["speculative_algorithm"] == "DDTREE" and info["speculative_ddtree_budget"] == 16
    assert info["speculative_num_draft_tokens"] == 17 and info["mem_fraction_static"] == 0.85
    assert info["context_length"] == 32768 and info["max_running_requests"] == 32
    assert info["version"] == "0.5.23"
    hs = info["ddtree_handshake"]
    assert hs["status"] == "ok"  # the warm-up ran a real target forward
    assert hs["expected_hidden_width"] == hs["draft_fc_in_features"] == hs["observed_hidden_width"] == 128
    assert hs["target_layer_ids"] == [1, 2] and hs["block_size"] == 16 and hs["budget"] == 16
    status, model = _json(http(server.url + "/model_info"))
    assert status == 200 and model["model_type"] == "qwen3" and model["is_generation"] is True
    status, models = _json(http(server.url + "/v1/models"))
    assert models["data"][0]["root"].endswith("target") and models["data"][0]["max_model_len"] == 32768


def test_generate_is_sglang_shaped_and_equals_ar_greedy(server: TinyServerProcess, expected) -> None:
    prompt = LAB_PROMPTS[0]
    status, out = _json(
        http(
            server.url + "/generate",
            {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 24}},
        )
    )
    assert status == 200
    assert out["output_ids"] == expected[prompt] and out["text"].strip()
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 24 and meta["finish_reason"] == {"type": "length", "length": 24}
    assert meta["prompt_tokens"] == len(TinyTokenizer().encode(prompt))
    assert 1 <= meta["spec_verify_ct"] < 24
    assert meta["spec_accept_length"] == pytest.approx(24 / meta["spec_verify_ct"])
    status, batch = _json(
        http(
            server.url + "/generate",
            {"text": list(LAB_PROMPTS[:2]), "sampling_params": {"temperature": 0, "max_new_tokens": 24}},
        )
    )
    assert status == 200 and [b["output_ids"] for b in batch] == [expected[p] for p in LAB_PROMPTS[:2]]
    status, by_ids = _json(http(server.url + "/generate", {"input_ids": [5, 6, 7], "sampling_params": {}}))
    assert status == 200 and len(by_ids["output_ids"]) == 128  # SGLang's default max_new_tokens


def test_a_request_without_a_temperature_samples_as_sglang_does(server: TinyServerProcess, expected) -> None:
    """SGLang's default temperature is 1.0: only temperature 0 (or < 1e-6, or top_k 1) is greedy."""
    prompt = LAB_PROMPTS[0]

    def ask(**sampling) -> list[int]:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, **sampling}}
        status, out = _json(http(server.url + "/generate", body))
        assert status == 200 and len(out["output_ids"]) == 24
        return out["output_ids"]

    sampled = [ask() for _ in range(6)]
    assert any(ids != expected[prompt] for ids in sampled), "six default requests all decoded greedily"
    assert ask(top_k=1) == expected[prompt]


def test_concurrent_requests_are_batched_and_answered_correctly(server: TinyServerProcess, expected) -> None:
    results: dict[str, list[int]] = {}

    def ask(prompt: str) -> None:
        body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 24}}
        status, out = _json(http(server.url + "/generate", body))
        assert status == 200
        results[prompt] = out["output_ids"]

    threads = [threading.Thread(target=ask, args=(p,)) for p in LAB_PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == expected
    batched = [line for line in server.log.splitlines() if "Prefill batch, #new-seq:" in line]
    assert any(int(line.split("#new-seq: ")[1].split(",")[0]) > 1 for line in batched)


def test_a_short_request_joins_a_running_one(server: TinyServerProcess, expected) -> None:
    """Continuous batching: a request arriving mid-generation is prefilled between rounds and answered
    while the long one is still decoding (and both answers are exact)."""
    got: dict = {}
    long_body = {"text": "the fox", "sampling_params": {"temperature": 0, "max_new_tokens": 1500}}
    long = threading.Thread(target=lambda: got.update(long=_json(http(server.url + "/generate", long_body))))
    before = server.log.count("Prefill batch")
    long.start()
    deadline = time.monotonic() + 30
    while server.log.count("Prefill batch") == before and time.monotonic() < deadline:
        time.sleep(0.01)
    prompt = LAB_PROMPTS[1]
    status, out = _json(
        http(server.url + "/generate",
             {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 24}})
    )
    still_running = long.is_alive()
    long.join(600)  # 1500 tokens: minutes on a loaded 2-core machine
    assert status == 200 and out["output_ids"] == expected[prompt]
    assert still_running, "the short request waited for the long one"
    assert "long" in got, "the long request did not answer (its thread failed or is still waiting)"
    assert got["long"][0] == 200 and got["long"][1]["meta_info"]["completion_tokens"] == 1500
    joined = [line for line in server.log.splitlines() if "Prefill batch" in line][before:]
    assert any("#running-req: 1," in line for line in joined)


def test_chat_completions_is_openai_shaped(server: TinyServerProcess) -> None:
    body = {
        "model": "x",
        "messages": [{"role": "user", "content": "the cat"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    status, out = _json(http(server.url + "/v1/chat/completions", body))
    assert status == 200 and out["object"] == "chat.completion"
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 12
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + 12


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        ("/generate", b"{not json", "Invalid JSON body"),
        ("/generate", {"sampling_params": {}}, "Either text, input_ids or input_embeds should be provided"),
        ("/generate", {"text": "a", "sampling_params": {"temperature": -1}}, "temperature"),
        ("/generate", {"text": "a", "sampling_params": {"max_new_tokenz": 3}}, "unknown field `max_new_tok"),
        ("/generate", {"input_ids": [1, 99999]}, "outside the vocabulary"),
        ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 40000}}, "maximum context length"),
        ("/generate", {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 3},
         "logprob_start_len=3 is higher than the number of input tokens"),
        ("/generate", {"text": "a", "return_logprob": "yes"}, "expected a boolean"),
        ("/v1/chat/completions", {"messages": []}, "messages must be a non-empty list"),
    ],
)
def test_bad_bodies_get_sglang_like_400s(server: TinyServerProcess, path, body, fragment) -> None:
    status, out = _json(http(server.url + path, body))
    assert status == 400
    # SGLang: its JSON-contract gate answers {"error": "..."}, the later checks {"error": {"message": ...}}
    error = out.get("error")
    if path.startswith("/v1/"):
        message = out["message"]
    else:
        message = error if isinstance(error, str) else error["message"]
    assert fragment in message


def test_return_logprob_gives_the_targets_logprobs_as_sglang_shapes_them(server: TinyServerProcess,
                                                                        models: Path) -> None:
    """Input positions from the prefill, output tokens from the DDTREE verify rows that decided them: both
    the target's own log-probabilities (the plain engine's, computed here), in SGLang's layout."""
    import torch

    tok = TinyTokenizer()
    prompt = tok.encode(LAB_PROMPTS[0])
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 12},
            "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 2}
    status, out = _json(http(server.url + "/generate", body))
    assert status == 200, out
    meta, ids = out["meta_info"], out["output_ids"]
    assert [e[1] for e in meta["input_token_logprobs"]] == prompt[1:]  # positions 1.., the first null
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    assert [e[1] for e in meta["output_token_logprobs"]] == ids and meta["output_token_logprobs_length"] == 12
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    with one_thread(), torch.no_grad():
        engine = TinyEngine(models / "target")
        seq = torch.tensor([prompt + ids])
        n = seq.shape[1]
        logits, _ = engine.target(seq, torch.arange(n)[None], torch.ones(n, n, dtype=torch.bool).tril()[None])
        logp = torch.log_softmax(logits[0].float(), dim=-1)
    want_in = [float(logp[i - 1, prompt[i]]) for i in range(2, len(prompt))]
    want_out = [float(logp[len(prompt) - 1 + k, t]) for k, t in enumerate(ids)]
    assert [e[0] for e in meta["input_token_logprobs"][1:]] == pytest.approx(want_in, abs=1e-4)
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx(want_out, abs=1e-4)
    assert [top[0][1] for top in meta["output_top_logprobs"]] == ids  # greedy: each its position's top-1
    status, tokens = _json(http(server.url + "/tokenize", {"prompt": [LAB_PROMPTS[0], "the cat"]}))
    assert status == 200 and tokens["tokens"][0] == prompt
    assert tokens["count"][1] == len(tok.encode("the cat"))


def test_metrics_use_sglang_names(server: TinyServerProcess) -> None:
    greedy = {"temperature": 0, "max_new_tokens": 16}
    http(server.url + "/generate", {"text": "the cat", "sampling_params": greedy})
    status, body = http(server.url + "/metrics")
    assert status == 200
    values = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    assert 1.0 < values["sglang:spec_accept_length"] <= 16
    assert 0 < values["sglang:spec_accept_rate"] < 1
    assert values["sglang:spec_verify_calls_total"] >= 1
    assert values["sglang:generation_tokens_total"] >= 16 and values["sglang:prompt_tokens_total"] > 0
    assert (
        values["sglang:ddtree_expected_hidden_width"] == values["sglang:ddtree_observed_hidden_width"] == 128
    )
    assert values["sglang:ddtree_budget"] == 16 and "sglang:num_running_reqs" in values


def test_logs_read_like_sglang(server: TinyServerProcess) -> None:
    log = server.log
    assert "server_args=ServerArgs(" in log
    assert log.index("Load weight end") < log.index("The server is fired up and ready to roll!")
    assert "KV Cache is allocated. #tokens:" in log
    assert "accept len: " in log and "Decode batch, #running-req:" in log


# ---------------------------------------------------------------------------- faults

DIM_MISMATCH = "DFLASH target_hidden feature dim mismatch"


@pytest.fixture(scope="module")
def dying(models: Path, tmp_path_factory) -> dict[str, TinyServerProcess]:
    """Start every failing server at once (they are independent), then wait for each to die."""
    tmp = tmp_path_factory.mktemp("faults")
    servers = {
        "capture_predicate": TinyServerProcess(
            _args(models), env={"DDTREE_LAB_FAULT": "capture_predicate"}, tmp=tmp
        ),
        "hidden_none": TinyServerProcess(_args(models), env={"DDTREE_LAB_FAULT": "hidden_none"}, tmp=tmp),
        "memory": TinyServerProcess(
            _args(models, "--mem-fraction-static", "0.02", "--context-length", "8192"), tmp=tmp
        ),
        "mismatched": TinyServerProcess(_args(models, draft="draft-mismatched"), tmp=tmp),
        "crash_after_start": TinyServerProcess(
            _args(models),
            env={"DDTREE_LAB_FAULT": "crash_after_start", "DDTREE_LAB_CRASH_AFTER_S": "1"},
            tmp=tmp,
        ),
    }
    for srv in servers.values():
        srv.wait_exit(90)
    return servers


@pytest.mark.parametrize(
    ("name", "cause", "texts"),
    [
        ("capture_predicate", "hidden_width_mismatch",
         [DIM_MISMATCH, "Expected shape [N, 128]", "drafter expects [N, 128]"]),
        ("hidden_none", "hidden_states_missing",
         ["DFLASH requires target aux hidden capture for prefill, but got None"]),
        ("memory", "mem_fraction_too_small",
         ["Not enough memory. Please try to increase --mem-fraction-static. "
          "Current value: mem_fraction_static=0.02"]),
        ("mismatched", "hidden_width_mismatch", [DIM_MISMATCH, "fc_width_mismatch"]),
        ("crash_after_start", None, ["The server is fired up and ready to roll!", "crash_after_start"]),
    ],
)  # fmt: skip
def test_faults_die_the_sglang_way(dying, name: str, cause: str | None, texts: list[str]) -> None:
    srv = dying[name]
    assert srv.proc.returncode == -signal.SIGKILL, srv.log  # a shell reports 137, systemd code=killed
    log = srv.log
    assert "Scheduler hit an exception:" in log and "Received sigquit from a child process" in log
    for text in texts:
        assert text in log
    if name != "crash_after_start":
        assert "The server is fired up and ready to roll!" not in log  # failed in the warm-up / start-up
    if cause:
        assert cause in [f.cause for f in diagnose.scan(log)]


def test_slow_start_answers_503_until_ready_and_sigterm_drains(models: Path, tmp_path: Path) -> None:
    srv = TinyServerProcess(
        _args(models), env={"DDTREE_LAB_FAULT": "slow_start", "DDTREE_LAB_START_DELAY_S": "2"}, tmp=tmp_path
    )
    try:
        deadline = time.monotonic() + 30
        codes = []
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):  # not listening yet
                codes.append(http(srv.url + "/health_generate", timeout=5)[0])
            if codes and codes[-1] == 200:
                break
            time.sleep(0.1)
        assert 503 in codes and codes[-1] == 200
        assert http(srv.url + "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 8}})[0] == 200
        _sigterm_drains(srv)
    finally:
        srv.stop()


def _sigterm_drains(srv: TinyServerProcess) -> None:
    """SIGTERM while a request runs: it is answered in full, then the server exits 0."""
    got: dict = {}
    body = {"text": "the cat", "sampling_params": {"temperature": 0, "max_new_tokens": 150}}
    t = threading.Thread(target=lambda: got.update(resp=_json(http(srv.url + "/generate", body))))
    before = srv.log.count("Prefill batch")
    t.start()
    deadline = time.monotonic() + 30
    while srv.log.count("Prefill batch") == before and time.monotonic() < deadline:
        time.sleep(0.01)
    srv.proc.send_signal(signal.SIGTERM)
    while "Received SIGTERM" not in srv.log and time.monotonic() < deadline:
        time.sleep(0.01)
    # As SGLang 0.5.23: health answers 503 while it drains, a new request is still served.
    short = {"text": "a", "sampling_params": {"max_new_tokens": 2}}
    during = {"health": http(srv.url + "/health", timeout=10)[0] if t.is_alive() else None,
              "new": _json(http(srv.url + "/generate", short)) if t.is_alive() else None}
    t.join(60)
    assert srv.wait_exit(30) == 0, srv.log
    status, out = got["resp"]
    assert status == 200 and out["meta_info"]["completion_tokens"] == 150
    assert "Received SIGTERM" in srv.log
    assert during["health"] == 503 and during["new"][0] == 200, (during, srv.log)


# ---------------------------------------------------------------------------- flags


def _parse_exit(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as err:
        build_parser().parse_args(["tiny-engine", "serve", *argv])
    return int(err.value.code), capsys.readouterr().err


def test_unknown_and_removed_flags_are_argparse_errors(capsys) -> None:
    code, err = _parse_exit(["--model-path", "m", "--no-such-flag"], capsys)
    assert code == 2 and "unrecognized arguments: --no-such-flag" in err
    code, err = _parse_exit(["--model-path", "m", "--cuda-graph-max-bs", "8"], capsys)
    assert code == 2 and "ambiguous option: --cuda-graph-max-bs could match" in err
    code, err = _parse_exit(["--model-path", "m", "--mamba-scheduler-strategy", "extra_buffer"], capsys)
    assert code == 2 and "unrecognized arguments" in err
    args = build_parser().parse_args(["tiny-engine", "serve", "--model-path", "m", *PROFILE,
                                      "--disable-cuda-graph"])  # fmt: skip
    assert args.mem_fraction_static == 0.85 and args.disable_cuda_graph


def test_the_old_lab_spelling_still_serves_but_is_not_listed(capsys) -> None:
    """`ddtree lab serve` (units and scripts written before the tiny engine had its own group)."""
    parser = build_parser()
    old = parser.parse_args(["lab", "serve", "--model-path", "m", *PROFILE])
    new = parser.parse_args(["tiny-engine", "serve", "--model-path", "m", *PROFILE])
    assert old.func is new.func
    def flags(args):
        return {k: v for k, v in vars(args).items() if k != "command" and not k.endswith("_command")}

    assert flags(old) == flags(new)
    with pytest.raises(SystemExit):
        parser.parse_args(["lab", "--help"])
    listed = capsys.readouterr().out
    assert "wheelhouse" in listed and "serve" not in listed and "make-models" not in listed


def test_unknown_algorithm_fails_like_sglang(models: Path, tmp_path: Path) -> None:
    srv = TinyServerProcess(_args(models, algo="EAGLE9"), tmp=tmp_path)
    assert srv.wait_exit(60) == 1
    assert "Unknown speculative algorithm name: EAGLE9" in srv.log


def test_memory_model_passes_real_profiles_and_fails_tiny_fractions(models: Path) -> None:
    cfg = json.loads((models / "target" / "config.json").read_text())
    plan = dict(target_config=cfg, draft_layers=2, weight_bytes=600_000, env={})
    for frac, ctx in ((0.85, 32768), (0.40, 16384), (0.25, 8192), (0.3, 32768)):
        assert memory_plan(mem_fraction_static=frac, context_length=ctx, **plan).max_total_num_tokens >= ctx
    with pytest.raises(RuntimeError, match=r"mem_fraction_static=0\.02"):
        memory_plan(mem_fraction_static=0.02, context_length=8192, **plan)
    with pytest.raises(RuntimeError, match="Not enough memory"):
        memory_plan(
            mem_fraction_static=0.85,
            context_length=32768,
            **{**plan, "env": {"DDTREE_LAB_DEVICE_MEMORY_MB": "8"}},
        )
