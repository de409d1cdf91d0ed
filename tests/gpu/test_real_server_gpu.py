"""The real SGLang 0.5.23 server on the H200 with CUDA graphs on: DDTREE's tree verify is lossless.

Runs only inside the GPU lab (``bash scripts/lab/gpu/device.sh pytest tests/gpu``: CUDA, SGLang's
files, the lab pairs in ``DDTREE_GPU_LAB_MODELS``); it skips anywhere else. Every server starts once,
all at once (``ddtree_sglang_gpu_lab.cases.start_all``), the balanced profile's flags with the GPU
lab's (Triton attention, CUDA graphs on, docs/sglang-gpu-lab.md), and is stopped by PID.

What must hold, against the same server without speculation, on the dense and the hybrid lab pair:
greedy output token-identical at batch 1, 4 and 16 and for requests joining a running batch, with the
target verify replayed from graphs (a prompt's first difference is accepted only at a near-tie of the
plain server's own top-2 log-probs, within ``tests._ties.NEAR_TIE_LOGPROB_GAP``: the bf16 logits of a
verify row may round apart from decode's; each report line counts them); the shipped budget (16)
and a larger one (32); page size 1 and 16;
T > 0 lossless by the chi-square test of the CPU suite; the live probe passes. Trees run under SGLang's
overlap scheduler (the default; ``DDTREE_GPU_SUITE_OVERLAP=0`` adds ``--disable-overlap-schedule``),
as ``/server_info`` says; their decode forward issues no host sync that DFLASH's does not (CUDA's sync
debug mode, ``ddtree_sglang_gpu_lab.sync_watch``); requests finishing and joining every round stay
identical (near-ties as above).
``DDTREE_GPU_SUITE_FAULT=chain_verify_graph`` starts the DDTREE servers with the pre-fix behaviour
(graphs captured for a chain): the suite must then fail on the hybrid pair.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from tests._ties import judge_greedy

torch = pytest.importorskip("torch")

MODELS = os.environ.get("DDTREE_GPU_LAB_MODELS")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU lab on the device H200)"),
    pytest.mark.skipif(
        importlib.util.find_spec("ddtree_sglang_gpu_lab") is None or not MODELS,
        reason="runs in the GPU lab: bash scripts/lab/gpu/device.sh pytest tests/gpu",
    ),
]

PROMPTS = [
    "the cat sees a", "under the old tree", "morning rain and", "the fox carries a small stone",
    "quiet evening", "a bird sings while the river", "The capital of France is",
    "<|im_start|>user\nthe old fox watches<|im_end|>\n<|im_start|>assistant\n",
    "the small bird sings while the wind", "a dog finds the", "the river and the stone", "the old house",
    "slow light over the garden", "the fox follows a", "green road near the", "evening song of the",
]  # fmt: skip
NEW_TOKENS = 64
CONFIGS = {  # name: (pair, budget, page size)
    "dense-b16": ("dense", 16, 1), "dense-b16-p16": ("dense", 16, 16), "dense-b32": ("dense", 32, 1),
    "hybrid-b16": ("hybrid", 16, 1), "hybrid-b16-p16": ("hybrid", 16, 16), "hybrid-b32": ("hybrid", 32, 1),
    # adaptive widths (block - 1 and 2 x block - 1): each round the width its batch size pays for
    "dense-auto": ("dense", "auto", 1), "hybrid-auto": ("hybrid", "auto", 1),
}  # fmt: skip
SAMPLE_PROMPT, SAMPLES, SAMPLE_TOKENS, P_FLOOR = "the cat sees", 600, 4, 1e-4
# The tree servers run under SGLang's overlap scheduler (the plugin's default) unless
# DDTREE_GPU_SUITE_OVERLAP=0, which turns it off (--disable-overlap-schedule).
OVERLAP = os.environ.get("DDTREE_GPU_SUITE_OVERLAP", "1") == "1"


def report(scenario: str, **figures: object) -> None:
    print(json.dumps({"suite": "gpu_real_server", "scenario": scenario, **figures}), flush=True)


@pytest.fixture(scope="session")
def servers():
    from ddtree_sglang_gpu_lab.cases import Spec, start_all

    fault = os.environ.get("DDTREE_GPU_SUITE_FAULT")
    # Every speculative server counts the host syncs inside its decode forwards (lab only). The tree
    # servers also run what is off by default until this suite has run it (DDTREE_GPU_SUITE_NEW=0
    # leaves them off): the GDN verify that keeps a parent's state in registers (its rows depth
    # first), counterfactual scoring on 5 % of greedy rounds, and the start-up price table (its dummy
    # rounds run before every test here: the identity tests hold after them).
    new = os.environ.get("DDTREE_GPU_SUITE_NEW", "1") == "1"
    switches = {"SGLANG_DDTREE_GDN_REUSE_PARENT": "1"}
    env = {"DDTREE_LAB_SYNC_WATCH": "1", **({"DDTREE_LAB_FAULT": fault} if fault else {}),
           **(switches if new else {})}  # fmt: skip
    specs = [Spec(f"{pair}-plain", pair) for pair in ("dense", "hybrid")]
    specs.append(Spec("dense-dflash", "dense", "DFLASH", env={"DDTREE_LAB_SYNC_WATCH": "1"}))
    for name, (pair, budget, page) in CONFIGS.items():
        over = {"speculative-ddtree-budget": budget,
                **({"speculative-ddtree-counterfactual-fraction": 0.05} if new else {})}  # fmt: skip
        extra = ["--page-size", str(page)] if page > 1 else []
        if new:
            extra.append("--speculative-ddtree-price-table")
        if not OVERLAP:
            extra.append("--disable-overlap-schedule")
        # An adaptive server's narrower width on its own backend and verify graphs (round/width_runners).
        own = {"SGLANG_DDTREE_WIDTH_GRAPHS": "1"} if budget == "auto" and new else {}
        specs.append(Spec(name, pair, "DDTREE", env={**env, **own}, overrides=over, extra=extra))
    logs = Path(os.environ.get("DDTREE_GPU_LAB_LOGS", "/tmp/gpulab/logs")) / "suite"
    started = start_all(specs, Path(MODELS), logs)
    yield started
    for server in started.values():
        if not isinstance(server, Exception):
            server.stop()


def _server(servers, name):
    server = servers[name]
    if isinstance(server, Exception):
        pytest.fail(f"{name} did not start: {server}")
    return server


def _ids(docs) -> list[list[int]]:
    return [d["output_ids"] for d in (docs if isinstance(docs, list) else [docs])]


def _with_top2(server, text: str | list[str], tokens: int) -> list[dict]:
    """The plain server's greedy answers with its top-2 log-probs at every output position."""
    payload = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": tokens},
               "return_logprob": True, "top_logprobs_num": 2}
    status, doc = server.request("/generate", payload)
    assert status == 200, str(doc)[:2000]
    return doc if isinstance(doc, list) else [doc]


def _answer(server, batch: int, *, top2: bool = False) -> list:
    """All 16 prompts, ``batch`` at a time in one request (batch 1: one request per prompt): ids, or
    with ``top2`` the whole answers with the top-2 log-probs."""
    out: list = []
    for i in range(0, len(PROMPTS), batch):
        chunk = PROMPTS[i : i + batch] if batch > 1 else PROMPTS[i]
        out += _with_top2(server, chunk, NEW_TOKENS) if top2 else _ids(server.generate(chunk, NEW_TOKENS))
    return out


@pytest.fixture(scope="session")
def plain_answers(servers):
    return {
        pair: {b: _answer(_server(servers, f"{pair}-plain"), b, top2=True) for b in (1, 4, 16)}
        for pair in ("dense", "hybrid")
    }


@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_tree_decode_is_token_identical_with_graphs_replayed(servers, plain_answers, config, batch):
    pair = CONFIGS[config][0]
    server = _server(servers, config)
    before = server.graph_replays()
    got = _answer(server, batch)
    replays = server.graph_replays() - before
    verdict = judge_greedy(plain_answers[pair][batch], got, PROMPTS)
    report("greedy", config=config, batch=batch, verify_replays=replays, **verdict.figures(),
           near_tie_positions=verdict.near_ties)
    assert verdict.ok, verdict.failures[:3]
    assert replays > 0, "no target verify was replayed from a CUDA graph"


@pytest.mark.parametrize("config", ["dense-b16", "hybrid-b16"])
def test_requests_joining_a_running_batch_are_token_identical(servers, plain_answers, config):
    pair = CONFIGS[config][0]
    server = _server(servers, config)
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(i: int, tokens: int) -> None:
        try:
            results[i] = server.generate(PROMPTS[i], tokens)["output_ids"]
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(0, 4 * NEW_TOKENS))]
    threads[0].start()
    for i in range(1, 8):
        time.sleep(0.05)
        threads.append(threading.Thread(target=run, args=(i, NEW_TOKENS)))
        threads[-1].start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    long_plain = _with_top2(_server(servers, f"{pair}-plain"), PROMPTS[0], 4 * NEW_TOKENS)
    verdict = judge_greedy(long_plain + plain_answers[pair][1][1:8], [results[i] for i in range(8)],
                           PROMPTS[:8])
    report("joining", config=config, **verdict.figures(), near_tie_positions=verdict.near_ties)
    assert verdict.ok, verdict.failures[:3]


def _samples(server, temperature: float) -> list[list[int]]:
    docs = server.generate([SAMPLE_PROMPT] * SAMPLES, SAMPLE_TOKENS, temperature=temperature, ignore_eos=True)
    return _ids(docs)


@pytest.mark.parametrize("config", ["dense-b16", "hybrid-b16"])
def test_sampling_at_t_above_zero_follows_the_plain_servers_distribution(servers, config):
    from tests._stats import homogeneity_p_value

    pair = CONFIGS[config][0]
    plain = _server(servers, f"{pair}-plain")
    tree, at_1, at_half = _samples(_server(servers, config), 1.0), _samples(plain, 1.0), _samples(plain, 0.5)
    figures = {}
    for pos in range(1, SAMPLE_TOKENS):
        p = homogeneity_p_value([s[pos] for s in tree], [s[pos] for s in at_1])
        figures[f"p_token_{pos}"] = round(p, 5)
        assert p > P_FLOOR, (
            pos,
            Counter(s[pos] for s in tree).most_common(6),
            Counter(s[pos] for s in at_1).most_common(6),
        )
    shifted = homogeneity_p_value([s[1] for s in at_half], [s[1] for s in at_1])
    report("sampling_t1", config=config, samples=SAMPLES, p_plain_t05_vs_t1=shifted, **figures)
    assert shifted < P_FLOOR, f"the test cannot tell T = 0.5 from T = 1 (p = {shifted})"


@pytest.mark.parametrize("config", ["dense-b16", "hybrid-b16"])
def test_live_probe_passes(servers, config):
    server = _server(servers, config)
    argv = [sys.executable, "-m", "ddtree_runtime", "probe", "live", "--url", server.url, "--json"]
    proc = subprocess.run(argv,
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    doc = json.loads(proc.stdout)
    report("live_probe", config=config, ok=doc["ok"], message=doc.get("message"))
    assert proc.returncode == 0 and doc["ok"], doc


@pytest.mark.parametrize("config", list(CONFIGS))
def test_trees_run_under_the_overlap_scheduler_when_asked(servers, config):
    status, info = _server(servers, config).request("/server_info")
    assert status == 200
    report("overlap", config=config, overlap=info.get("ddtree_overlap_schedule"))
    assert info["ddtree_overlap_schedule"] is OVERLAP and info["disable_overlap_schedule"] is not OVERLAP


def _decode_syncs(server, worker: str, batch: int) -> list[dict]:
    """The sync-watch records of ``worker``'s decode forwards while the 16 prompts run ``batch`` at
    a time (the server counts with torch.cuda.set_sync_debug_mode, lab only)."""
    from ddtree_sglang_gpu_lab.sync_watch import parse

    seen = len(parse(server.log))
    _answer(server, batch)
    return [r for r in parse(server.log)[seen:] if r["worker"] == worker]


WATCHED = ["dense-b16", "dense-b16-p16", "hybrid-b16", "hybrid-b16-p16", "dense-b32",
           "dense-auto", "hybrid-auto"]  # fmt: skip


@pytest.mark.parametrize("config", WATCHED)
def test_the_tree_decode_forward_issues_no_host_sync_the_chain_does_not(servers, config):
    chain = _decode_syncs(_server(servers, "dense-dflash"), "DFLASH", 4)
    tree = _decode_syncs(_server(servers, config), "DDTREE", 4)
    assert tree and chain, "no decode forward was watched"
    worst_chain = max(r["syncs"] for r in chain)
    worst = max(tree, key=lambda r: r["syncs"])
    report("decode_syncs", config=config, rounds=len(tree), max_syncs=worst["syncs"],
           total_syncs=sum(r["syncs"] for r in tree), chain_rounds=len(chain), chain_max_syncs=worst_chain,
           sites=worst["sites"])  # fmt: skip
    assert worst["syncs"] <= worst_chain, worst


@pytest.mark.parametrize("config", ["dense-b16", "dense-b16-p16", "hybrid-b16", "hybrid-b16-p16"])
def test_requests_finishing_and_joining_every_round_are_token_identical(servers, plain_answers, config):
    """32 requests of 1 to 64 tokens, started 20 ms apart, more than the server runs at once: every
    round some finish and queued ones join (under overlap a finished request's row may be handed to
    a new one while its last round is in flight)."""
    pair = CONFIGS[config][0]
    server = _server(servers, config)
    lengths = [1 + (11 * i + 3) % 64 for i in range(32)]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = server.generate(PROMPTS[i % len(PROMPTS)], lengths[i])["output_ids"]
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = []
    for i in range(len(lengths)):
        threads.append(threading.Thread(target=run, args=(i,)))
        threads[-1].start()
        time.sleep(0.02)
    for t in threads:
        t.join(300)
    assert not errors, errors
    plain = plain_answers[pair][1]  # 64 tokens each, with the plain server's top-2 log-probs
    want = [{**plain[i % len(PROMPTS)], "output_ids": plain[i % len(PROMPTS)]["output_ids"][:n]}
            for i, n in enumerate(lengths)]  # fmt: skip
    verdict = judge_greedy(want, [results[i] for i in range(len(lengths))],
                           [PROMPTS[i % len(PROMPTS)] for i in range(len(lengths))])
    report("churn", config=config, **verdict.figures(), near_tie_positions=verdict.near_ties)
    assert verdict.ok, verdict.failures[:3]


@pytest.mark.parametrize("config", ["dense-auto", "hybrid-auto"])
def test_an_adaptive_server_prices_and_runs_each_width_and_says_what_it_chose(servers, config):
    """After the suite's traffic on it (batch 1, 4 and 16): every width priced at start-up, every width ran
    rounds (exploration at least), and the server reports its table (the figures: its choice per batch
    size against the prices, for the adaptive-width issue's evidence)."""
    status, info = _server(servers, config).request("/server_info")
    assert status == 200
    widths = [str(w) for w in info["speculative_ddtree_widths"]]
    states = [s for s in info.get("internal_states", []) if "ddtree_widths" in s]
    assert states, "no ddtree_widths in /server_info"
    choice, prices = states[0]["ddtree_widths"], states[0].get("ddtree_prices", {})
    report("adaptive_widths", config=config, **choice, prices=prices)
    assert {e["width"] for e in prices.get("entries", [])} == set(widths)
    assert all(choice["rounds"].get(w, 0) > 0 for w in widths), choice


READY_LINE = "The server is fired up and ready to roll"


@pytest.mark.parametrize("config", list(CONFIGS))
def test_no_kernel_compiles_inside_a_tree_round_once_the_server_is_ready(servers, config):
    """Every decode forward since the server said ready (the whole suite's traffic: batch 1, 4 and
    16, joining and finishing requests, T > 0; this test runs last in the module) compiled nothing:
    the round's kernels were compiled for every captured batch size at start-up (round_graphs)."""
    from ddtree_sglang_gpu_lab.sync_watch import parse

    log = _server(servers, config).log
    after = log[log.find(READY_LINE) :] if READY_LINE in log else log
    rounds = [r for r in parse(after) if r["worker"] == "DDTREE"]
    compiled = Counter(name for r in rounds for name in r.get("compiled", []))
    report("compiles_after_ready", config=config, rounds=len(rounds),
           compiles=sum(r.get("compiles", 0) for r in rounds), kernels=dict(compiled))  # fmt: skip
    assert rounds, "no decode forward was watched"
    assert sum(r.get("compiles", 0) for r in rounds) == 0, dict(compiled)
