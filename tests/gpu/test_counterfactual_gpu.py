"""Counterfactual acceptance on the H200 (issue 41, "The hook lands"): a chain server scoring every round
predicts what budgets 16 and 32 accept; servers running those budgets measure it on the same prompts, on
both lab pairs.

Runs only inside the GPU lab (``bash scripts/lab/gpu/device.sh pytest tests/gpu/test_counterfactual_gpu.py``),
as tests/gpu/test_real_server_gpu.py does (the same server class, flags and fixtures); it skips anywhere
else. Six servers, started at once (``cases.start_all``), CUDA graphs on, overlap scheduler on, per pair
(dense, hybrid):

* ``<pair>-cf-chain``: ``--speculative-ddtree-topk-cap 1``, budget = block - 1 (DFlash's own decode, its
  greedy head folded into the draft graph; the hook ranks the drafter's rows with the plugin's head),
  scoring every round (``--speculative-ddtree-counterfactual-fraction 1.0``);
* ``<pair>-cf-b16``, ``<pair>-cf-b32``: the tree round at budgets 16 and 32 (its round graphs: the hook reads
  the plan bucket's depth rows after the replay), scoring every round as well.

Counters are read before and after the prompts and differenced, so start-up warm-up rounds (tree servers
only) are left out. What must hold: each tree server scores its own budget exactly (accepted + 1 = what
each real round emitted: the bucket's logits are the plan graph's); the chain server its own chain to
within 0.5 % of the tokens (DFlash's greedy head and the plugin's may split a bf16 near-tie: reported);
each budget's prediction (renewal-weighted tokens per round) within 5 % of the tokens per scored round the
server running it emitted. Also reported: SGLang's accept length and how many prompts differ from the
chain server's output (bf16 near-ties, tests/_ties.py). One JSON line per pair.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

MODELS = os.environ.get("DDTREE_GPU_LAB_MODELS")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU lab on the device H200)"),
    pytest.mark.skipif(
        importlib.util.find_spec("ddtree_sglang_gpu_lab") is None or not MODELS,
        reason="runs in the GPU lab: bash scripts/lab/gpu/device.sh pytest tests/gpu",
    ),
]

from tests.gpu.test_real_server_gpu import PROMPTS  # noqa: E402 (the suite's prompts, one list)

NEW_TOKENS = 160
BLOCK = 16  # the lab drafters' block
HORIZON = BLOCK - 1
PAIRS = ("dense", "hybrid")
BUDGETS = (16, 32)
BOUND = 0.05  # the issue's: the prediction within 5 % of the real tokens per round
CHAIN_SLACK = 0.005
SCORE = {"speculative-ddtree-counterfactual-fraction": 1.0}


def report(scenario: str, **figures: object) -> None:
    print(json.dumps({"suite": "gpu_counterfactual", "scenario": scenario, **figures}), flush=True)


@pytest.fixture(scope="module")
def servers():
    from ddtree_sglang_gpu_lab.cases import Spec, start_all

    chain = {"speculative-ddtree-budget": HORIZON, "speculative-ddtree-topk-cap": 1, **SCORE}
    specs = []
    for pair in PAIRS:
        specs.append(Spec(f"{pair}-cf-chain", pair, "DDTREE", overrides=chain))
        specs += [Spec(f"{pair}-cf-b{b}", pair, "DDTREE", overrides={"speculative-ddtree-budget": b, **SCORE})
                  for b in BUDGETS]  # fmt: skip
    logs = Path(os.environ.get("DDTREE_GPU_LAB_LOGS", "/tmp/gpulab/logs")) / "counterfactual"
    started = start_all(specs, Path(MODELS), logs)
    yield started
    for server in started.values():
        if not isinstance(server, Exception):
            server.stop()


def _parsed(server) -> dict | None:
    from ddtree_runtime.health.counterfactual_counters import NoCounterfactual, parse_metrics

    try:
        return parse_metrics(server.metrics())
    except NoCounterfactual:
        return None  # no decode round yet


def _stable(server, timeout: float = 60) -> dict:
    """The counters once they stop changing (published when the scheduler goes idle)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        now = _parsed(server)
        if now is not None and now == last:
            return now
        last = now
        time.sleep(1.0)
    raise AssertionError(f"{server.name}: no stable counterfactual counters in {timeout:g} s: {last}")


def _minus(after: dict, before: dict | None) -> dict[str, Any]:
    """The counters of the rounds between two reads (counters only grow)."""
    if before is None:
        return after
    out: dict[str, Any] = {k: v - before.get(k, 0) for k, v in after.items() if k != "budgets"}
    out["budgets"] = {
        label: {k: v - before["budgets"].get(label, {}).get(k, 0) for k, v in fields.items()}
        for label, fields in after["budgets"].items()
    }
    # A round sampled before the first read can be settled (scored, dropped or discarded) after it:
    # seen on the H100, 1459 sampled against 1460 settled in a window. Such rounds count as sampled
    # inside the window; the server's cumulative counters are checked whole (``runs``).
    settled = out["rounds_scored"] + out["rounds_dropped"] + out["rounds_discarded"]
    out["rounds_sampled"] = max(out["rounds_sampled"], settled)
    return out


@pytest.fixture(scope="module")
def runs(servers) -> dict[str, dict]:
    from ddtree_runtime.core.counterfactual_invariants import check_counters
    from ddtree_runtime.health.counterfactual_counters import estimates

    out = {}
    for name, server in servers.items():
        if isinstance(server, Exception):
            pytest.fail(f"{name} did not start: {server}")
        before = _parsed(server)
        answers = server.generate(PROMPTS, NEW_TOKENS, ignore_eos=True)
        after = _stable(server)
        check_counters(after, horizon=HORIZON)  # every invariant on the server's whole count
        counts = _minus(after, before)
        tokens = sum(a["meta_info"]["completion_tokens"] for a in answers)
        verify = sum(a["meta_info"]["spec_verify_ct"] for a in answers)
        out[name] = {
            "ids": [a["output_ids"] for a in answers],
            "accept_length": tokens / verify,  # SGLang's figure (the prefill's token included)
            "per_round": counts["real_emitted_tokens"] / counts["rounds_scored"],
            "counts": counts,
            "estimates": {e.label: e for e in estimates(check_counters(counts, horizon=HORIZON))},
        }
    return out


def _own_mismatch(run: dict, label: str) -> float:
    """|accepted + rounds - real tokens| / real tokens of the server's own setting (0: exact)."""
    counts = run["counts"]
    own, n, real = counts["budgets"][label], counts["rounds_scored"], counts["real_emitted_tokens"]
    return abs(own["accepted_tokens"] + n - real) / real


@pytest.mark.parametrize("pair", PAIRS)
def test_a_chain_server_predicts_budgets_16_and_32_within_5_percent(runs, pair):
    chain = runs[f"{pair}-cf-chain"]
    chain_mismatch = _own_mismatch(chain, "chain")
    figures, errors = {}, {}
    for b in BUDGETS:
        real = runs[f"{pair}-cf-b{b}"]
        assert _own_mismatch(real, str(b)) == 0, (
            pair,
            b,
            real["counts"],
        )  # the bucket's logits are the graph's
        assert real["estimates"][str(b)].running
        est = chain["estimates"][str(b)]
        errors[b] = est.tokens_per_round / real["per_round"] - 1
        differing = sum(a != c for a, c in zip(real["ids"], chain["ids"], strict=True))
        figures[str(b)] = {
            "predicted": round(est.tokens_per_round, 4), "predicted_se": round(est.tokens_per_round_se, 4),
            "real": round(real["per_round"], 4), "error_pct": round(100 * errors[b], 2),
            "real_rounds_scored": real["counts"]["rounds_scored"],
            "real_accept_length": round(real["accept_length"], 4),
            "prompts_differing_from_chain": differing,
        }  # fmt: skip
    report(
        "chain_predicts_budgets", pair=pair, rounds_scored=chain["counts"]["rounds_scored"],
        chain_own_mismatch=round(chain_mismatch, 5), chain_real=round(chain["per_round"], 4),
        chain_predicted=round(chain["estimates"]["chain"].tokens_per_round, 4), **figures,
    )  # fmt: skip
    assert chain_mismatch <= CHAIN_SLACK, (pair, chain["counts"])
    assert all(abs(e) <= BOUND for e in errors.values()), figures
