"""Counterfactual acceptance scored by the plugin's worker inside the real SGLang 0.5.23 server, on this
CPU, with the lab's tiny dense pair (launched as tests/sglang/test_real_server.py launches it: ct131's
flags, ``--enable-metrics`` among them).

One server at a time, the same prompts in one batch each (greedy, EOS ignored, so every server emits the
same tokens), every round scored (fraction 1.0):

1. the chain (``--speculative-ddtree-topk-cap 1``, budget = block - 1: DFlash's own decode, the drafter's
   rows teed from its runner): its /metrics carry the ``sglang:ddtree_counterfactual_*`` series; its own
   setting, the chain candidate, is scored exactly (accepted + 1 = the tokens each real round emitted, on
   every scored round: the paired difference is 0); ``ddtree tune --url`` reads them;
2. servers running budgets 16 and 32 (the tree round, eager on a CPU), also scoring every round: their own
   budget is scored exactly too (the tree round's path into the scorer), and their tokens per scored round
   are what the chain server's prediction for that budget is held to: within 6 % (on this pair it runs
   3.4 % and 4.6 % low, as on the tiny engine). The issue's 5 % on the H200:
   tests/gpu/test_counterfactual_gpu.py.

Each scenario prints one JSON line with its figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddtree_runtime.health.counterfactual_counters import estimates, parse_metrics, read_counters
from tests.sglang._real_server import RealServer
from tests.sglang.test_real_server import PROMPTS  # the CPU server's prompts, one list
from tests.unit._tiny_engine import lab_models

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

NEW_TOKENS = 96
BLOCK = 16  # the lab drafter's block
HORIZON = BLOCK - 1
TREE_BUDGETS = (16, 32)
# The bound is 5 % on the H200 (tests/gpu/test_counterfactual_gpu.py); on this tiny CPU pair the
# prediction runs 3.4 % and 4.6 % low (docs/counterfactual-acceptance.md): a deterministic run, held with
# a point of slack for a host whose float order differs.
BOUND = 0.06
SCORE_EVERY_ROUND = ["--speculative-ddtree-counterfactual-fraction", "1.0"]


def report(scenario: str, **figures: object) -> None:
    print(json.dumps({"scenario": scenario, **figures}))


def counters(server: RealServer, timeout: float = 60) -> dict:
    """The parsed counters once they stop changing (the worker publishes them when its scheduler goes idle,
    right after the last answer)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            now = parse_metrics(server.metrics())
        except ValueError:
            now = None
        if now is not None and now["rounds_scored"] > 0 and now == last:
            return now
        last = now
        time.sleep(1.0)
    raise AssertionError(f"no stable counterfactual counters in {timeout:g} s: {last}\n{server.log[-3000:]}")


def run_server(models: Path, log_dir: Path, extra: list[str], *, tune: bool = False) -> dict:
    with RealServer(models / "target", models / "draft", log_dir=log_dir, extra=extra) as server:
        ready = server.wait_ready()
        answers = server.generate(PROMPTS, NEW_TOKENS, ignore_eos=True)
        counts = counters(server)
        text = server.metrics()
        ran = None
        if tune:
            ran = subprocess.run(
                [sys.executable, "-m", "ddtree_runtime", "tune", "--url", server.url, "--min-rounds", "20",
                 "--concurrency", "6", "--json"],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
    checked = read_counters(text, horizon=HORIZON)  # every invariant a real scorer keeps
    tokens = sum(a["meta_info"]["completion_tokens"] for a in answers)
    verify = sum(a["meta_info"]["spec_verify_ct"] for a in answers)
    return {
        "ready_seconds": ready,
        "output_ids": [a["output_ids"] for a in answers],
        "accept_length": tokens / verify,  # SGLang's own figure (the prefill's token included)
        "verify_rounds": verify,
        "counts": counts,
        "estimates": {e.label: e for e in estimates(checked)},
        "tune": ran,
    }


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    models = lab_models()
    chain = ["--speculative-ddtree-budget", str(HORIZON), "--speculative-ddtree-topk-cap", "1"]
    out = {
        "chain": run_server(models, tmp_path_factory.mktemp("chain"), [*chain, *SCORE_EVERY_ROUND], tune=True)
    }
    for budget in TREE_BUDGETS:
        out[str(budget)] = run_server(
            models, tmp_path_factory.mktemp(f"tree{budget}"),
            ["--speculative-ddtree-budget", str(budget), *SCORE_EVERY_ROUND],
        )  # fmt: skip
    return out


def _own_setting_is_scored_exactly(run: dict, label: str) -> None:
    counts, est = run["counts"], run["estimates"][label]
    own = counts["budgets"][label]
    n, real = counts["rounds_scored"], counts["real_emitted_tokens"]
    # every scored round: candidate accepted + 1 == the tokens the real round emitted
    assert own["accepted_tokens"] + n == real, (label, own, counts)
    assert own["round_weight"] == pytest.approx(n, abs=1e-9)
    assert own["accepted_tokens_x_real"] == counts["real_emitted_tokens_squared"] - real
    assert est.running and est.tokens_per_round == pytest.approx(real / n)


def test_a_chain_server_scoring_every_round_scores_its_own_setting_exactly(servers):
    run = servers["chain"]
    counts = run["counts"]
    assert set(counts["budgets"]) == {"8", "16", "32", "64", "chain"}
    assert counts["rounds_dropped"] == 0  # a ring of L entries never fills
    assert counts["rounds_sampled"] >= counts["rounds_scored"] + counts["rounds_discarded"]
    # nearly every decode round of the 6 requests is scored (a request's last rounds never resolve)
    assert counts["rounds_scored"] >= 0.8 * run["verify_rounds"], (counts, run["verify_rounds"])
    _own_setting_is_scored_exactly(run, "chain")
    report(
        "counterfactual_chain_server", ready_seconds=run["ready_seconds"],
        rounds_sampled=counts["rounds_sampled"], rounds_scored=counts["rounds_scored"],
        rounds_discarded=counts["rounds_discarded"], verify_rounds=run["verify_rounds"],
        chain_predicted=round(run["estimates"]["chain"].tokens_per_round, 4),
        chain_real_scored_rounds=round(counts["real_emitted_tokens"] / counts["rounds_scored"], 4),
        server_accept_length=round(run["accept_length"], 4),
    )  # fmt: skip


@pytest.mark.parametrize("budget", TREE_BUDGETS)
def test_a_tree_server_scores_its_own_budget_exactly(servers, budget):
    _own_setting_is_scored_exactly(servers[str(budget)], str(budget))


def test_ddtree_tune_reads_the_real_servers_counters(servers):
    tune = servers["chain"]["tune"]
    assert tune.returncode == 0, tune.stdout + tune.stderr
    rec = json.loads(tune.stdout)
    chain = next(e for e in rec["estimates"] if e["label"] == "chain")
    assert chain["running"] is True  # the current setting, read from /server_info, paired
    assert rec["counts"]["rounds_scored"] == servers["chain"]["counts"]["rounds_scored"]


def test_the_chain_servers_prediction_is_within_6_percent_of_servers_running_the_budgets(servers):
    """Same output tokens (lossless greedy), so the comparison is on the same positions: the prediction
    against the real server's tokens per round on its scored rounds (each round's tokens exactly, as
    asserted above; a request's last unresolved rounds left out)."""
    chain = servers["chain"]
    figures, errors = {}, {}
    for budget in TREE_BUDGETS:
        run = servers[str(budget)]
        assert run["output_ids"] == chain["output_ids"], budget
        est = chain["estimates"][str(budget)]
        real = run["counts"]["real_emitted_tokens"] / run["counts"]["rounds_scored"]
        errors[budget] = est.tokens_per_round / real - 1
        figures[str(budget)] = {
            "predicted": round(est.tokens_per_round, 4),
            "predicted_se": round(est.tokens_per_round_se, 4),
            "real_scored_rounds": round(real, 4),
            "real_accept_length": round(run["accept_length"], 4),
            "error_pct": round(100 * errors[budget], 2),
        }
    report("counterfactual_prediction_vs_real", chain_rounds=chain["counts"]["rounds_scored"], **figures)
    assert all(abs(e) <= BOUND for e in errors.values()), figures
