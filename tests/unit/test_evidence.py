"""Decisions only on evidence that can be true (issue 43): `ddtree tune` and the counterfactual counters'
readers refuse counters no scorer can emit, propose only settings the host can run and only against a
known current setting, and speak in one printable line with the documented exit codes; the rotation and
the canary's traffic verdict refuse a router's answer or counters that cannot be true.

The counters are the real scorer's (core/counterfactual.py) over simulated rounds
(tests/unit/_counterfactual_sim.py), then corrupted: no hand-written numbers."""

from __future__ import annotations

import copy
import functools
import io
import json
import math
import random
import re
from pathlib import Path
from typing import Any

import pytest

from ddtree_runtime.cli import main
from ddtree_runtime.core.counterfactual_invariants import (
    PREFIX,
    EvidenceError,
    check_counters,
    counts_from_snapshot,
)
from ddtree_runtime.core.decoder_settings import MAX_BUDGET, SettingsError
from ddtree_runtime.health import counterfactual_counters as cf
from tests.unit._counterfactual_sim import simulate

HORIZON = 15  # the lab's and Qwen3.6-27B-DFlash's block 16
CANDIDATES = "chain,8,16,32,64"
# A measured cost table (--round-ms-json) that makes budget 32 dear: a server running 32 is better off at
# 16 or below, whatever the simulation's acceptance, so the valid counters yield a proposal.
TABLE = {"chain": {"1": 20.0}, "8": {"1": 20.5}, "16": {"1": 21.0}, "32": {"1": 60.0}, "64": {"1": 90.0}}


@functools.cache
def _sim(running: str, seed: int = 7) -> dict:
    return simulate(
        seed, rounds=24, slots=8, horizon=HORIZON, vocab=12, candidates=CANDIDATES, running=running
    )


def sim(running: str = "32", seed: int = 7) -> dict:
    return copy.deepcopy(_sim(running, seed))


def text(counts: dict, model: str = "lab") -> str:
    """The counts as a server's /metrics says them (the lab server's spelling, floats as repr writes them)."""
    lines = []
    for k, v in counts.items():
        if k != "budgets":
            lines.append(f'{PREFIX}{k}_total{{model_name="{model}"}} {float(v)!r}')
    for label, c in counts["budgets"].items():
        for k, v in c.items():
            lines.append(f'{PREFIX}{k}_total{{budget="{label}",model_name="{model}"}} {float(v)!r}')
    return "\n".join(lines) + "\n"


def tune(tmp_path: Path, capsys, body: str | bytes, *args: str) -> tuple[int, str, str]:
    path = tmp_path / "scrape.txt"
    path.write_bytes(body if isinstance(body, bytes) else body.encode())
    table = tmp_path / "ms.json"
    table.write_text(json.dumps(TABLE))
    code = main(
        [
            "tune",
            "--metrics-file",
            str(path),
            "--concurrency",
            "1",
            "--horizon",
            str(HORIZON),
            "--min-rounds",
            "50",
            "--round-ms-json",
            str(table),
            "--propose",
            "--json",
            *args,
        ]
    )
    out, err = capsys.readouterr()
    return code, out, err


def refused(tmp_path: Path, capsys, body: str | bytes, *args: str, code: int = 2) -> str:
    """Tune refuses with ``code``, proposes nothing and says why in one printable line."""
    got, out, err = tune(tmp_path, capsys, body, *args)
    assert got == code, (got, out, err)
    assert out == "" and "host_vars" not in out
    line = err.removesuffix("\n")
    assert line.startswith("ddtree tune: ") and "\n" not in line and line.isprintable(), err
    return line


def m(counts: dict) -> int:
    return int(counts["rounds_scored"])


# ----------------------------------------------------------------------------------- valid evidence


@pytest.mark.parametrize("running", ["chain", "16", "32"])
def test_the_scorers_own_counters_pass_every_check(running: str) -> None:
    counts = sim(running)
    counters = check_counters(counts, horizon=HORIZON, running=running)
    assert counters.rounds_scored > 100 and set(counters.candidates) == set(CANDIDATES.split(","))
    est = {e.label: e for e in cf.estimates(counters)}
    assert est[running].running and est[running].paired_se == 0
    assert est[running].tokens_per_round == pytest.approx(counts["real_emitted_tokens"] / m(counts))
    # Nested trees on the same rounds: a larger budget never accepts less.
    accepted = [counts["budgets"][b]["accepted_tokens"] for b in ("8", "16", "32", "64")]
    assert accepted == sorted(accepted)


def test_the_real_renderer_and_reader_agree(capsys) -> None:
    """The lab server's collector renders the scorer's snapshot; the reader gives the same counts back."""
    from ddtree_runtime.tiny_engine.serving_metrics import ServingMetrics

    counts = sim("chain")
    snapshot = {
        "rounds_scored": counts["rounds_scored"],
        "rounds_sampled": counts["rounds_sampled"],
        "rounds_dropped": counts["rounds_dropped"],
        "rounds_discarded": counts["rounds_discarded"],
        "real_emitted": counts["real_emitted_tokens"],
        "real_emitted_sq": counts["real_emitted_tokens_squared"],
        "candidates": [
            {
                "label": k,
                "accepted": v["accepted_tokens"],
                "accepted_sq": v["accepted_tokens_squared"],
                "round_weight": v["round_weight"],
                "accepted_x_real": v["accepted_tokens_x_real"],
            }
            for k, v in counts["budgets"].items()
        ],
    }
    assert counts_from_snapshot(snapshot) == counts
    rendered = ServingMetrics("lab", counterfactual=lambda: snapshot).render().decode()
    assert cf.read_counters(rendered, horizon=HORIZON, running="chain").to_counts() == counts


def test_valid_counters_from_a_server_running_32_yield_a_proposal(tmp_path: Path, capsys) -> None:
    """The baseline every refusal below departs from: the same counters, uncorrupted, are acted on."""
    code, out, err = tune(tmp_path, capsys, text(sim()), "--current", "32")
    assert code == 0, err
    rec = json.loads(out)
    assert rec["change"] and rec["recommended"] in ("chain", "8", "16") and rec["host_vars"] is not None
    assert rec["gain_se_method"] == "paired"
    rows = {r["setting"]: r for r in rec["table"]}
    assert "above 32" in rows["64"]["left_out"]  # above the validated maximum: never proposed


# ------------------------------------------------------------------------- counters that cannot be true


def _bound(counts: dict, label: str) -> int:
    per_round = HORIZON if label == "chain" else min(int(label), HORIZON)
    return m(counts) * per_round


@pytest.mark.parametrize(("label", "per_round"), [("8", 8), ("16", 15)])  # 16: at most the horizon, 15
def test_a_tree_accepting_more_than_its_budget_a_round_is_refused(tmp_path, capsys, label, per_round) -> None:
    counts = sim()
    counts["budgets"][label]["accepted_tokens"] = _bound(counts, label) + 1
    line = refused(tmp_path, capsys, text(counts), "--current", "32")
    assert (
        f'accepted_tokens_total{{budget="{label}"}}' in line and f"{m(counts)} rounds x {per_round}" in line
    )


def test_the_chain_accepting_more_than_its_horizon_is_refused(tmp_path: Path, capsys) -> None:
    counts = sim()
    counts["budgets"]["chain"]["accepted_tokens"] = _bound(counts, "chain") + 3
    line = refused(tmp_path, capsys, text(counts), "--current", "32")
    assert 'accepted_tokens_total{budget="chain"}' in line and f"x {HORIZON}: the chain" in line


def test_more_rounds_scored_than_sampled_is_refused(tmp_path: Path, capsys) -> None:
    counts = sim()
    counts["rounds_sampled"] = m(counts) - 1
    line = refused(tmp_path, capsys, text(counts), "--current", "32")
    assert "rounds_sampled_total = " in line and "each was sampled first" in line


@pytest.mark.parametrize("weight", [0.0, 1.0])
def test_a_round_weight_implying_more_tokens_than_a_round_holds_is_refused(tmp_path, capsys, weight) -> None:
    counts = sim()
    counts["budgets"]["16"]["round_weight"] = weight  # real tokens / weight: hundreds of tokens a round
    line = refused(tmp_path, capsys, text(counts), "--current", "32")
    assert 'round_weight_total{budget="16"}' in line and "a <= 15 every round" in line


def test_a_negative_variance_is_refused(tmp_path: Path, capsys) -> None:
    counts = sim()
    a = counts["budgets"]["16"]["accepted_tokens"]
    counts["budgets"]["16"]["accepted_tokens_squared"] = (
        math.ceil(a * a / m(counts)) - 1
    )  # sum a^2 < (sum a)^2/n
    line = refused(tmp_path, capsys, text(counts), "--current", "32")
    assert 'accepted_tokens_squared_total{budget="16"}' in line and "variance is never negative" in line


def test_a_forged_cross_term_is_refused(tmp_path: Path, capsys) -> None:
    """A cross term inside its per-round range (sum a <= sum a r <= 16 sum a) that no rounds give with the
    other counters: a covariance of a and r beyond what their spreads allow. It would fake a paired error
    near zero and a confident proposal."""
    counts = sim()
    c, n, r, rs = (
        counts["budgets"]["16"],
        m(counts),
        counts["real_emitted_tokens"],
        counts["real_emitted_tokens_squared"],
    )
    a, q = c["accepted_tokens"], c["accepted_tokens_squared"]
    most = (
        a * r + math.isqrt((n * q - a * a) * (n * rs - r * r))
    ) // n  # the largest sum a r any rounds give
    c["accepted_tokens_x_real"] = most + 2
    assert a <= most + 2 <= (HORIZON + 1) * a
    line = refused(tmp_path, capsys, text(counts), "--current", "32")
    assert 'accepted_tokens_x_real_total{budget="16"}' in line and "covariance" in line
    c["accepted_tokens_x_real"] = most  # at the edge the checks pass
    check_counters(counts, horizon=HORIZON)


def test_a_larger_budget_accepting_less_than_a_smaller_one_is_refused(tmp_path: Path, capsys) -> None:
    counts = sim()
    b = counts["budgets"]
    assert b["8"]["accepted_tokens"] < b["16"]["accepted_tokens"]
    b["8"], b["16"] = b["16"], b["8"]
    line = refused(tmp_path, capsys, text(counts), "--current", "32")
    assert 'budget="16"' in line and "best-first trees are nested" in line


def test_fewer_tokens_emitted_than_rounds_is_refused(tmp_path: Path, capsys) -> None:
    counts = sim()
    counts["real_emitted_tokens"] = m(counts) - 1
    line = refused(tmp_path, capsys, text(counts), "--current", "32")
    assert "real_emitted_tokens_total = " in line and "a round emits at least one token" in line


@pytest.mark.parametrize("value", [1e300, 2.0**53, float("inf"), float("nan"), -1.0, 12.5])
def test_values_no_counter_holds_are_refused(tmp_path: Path, capsys, value: float) -> None:
    counts = sim()
    counts["budgets"]["16"]["accepted_tokens"] = value
    line = refused(tmp_path, capsys, text(counts), "--current", "32")
    assert 'accepted_tokens_total{budget="16"}' in line


def test_the_same_series_twice_is_refused(tmp_path: Path, capsys) -> None:
    body = text(sim())
    line = refused(tmp_path, capsys, body + body, "--current", "32")  # two scrapes concatenated
    assert "given twice" in line
    one = body.splitlines()
    line = refused(tmp_path, capsys, "\n".join([*one, one[3]]) + "\n", "--current", "32")  # one line twice
    assert "given twice" in line


def test_two_models_counters_in_one_text_are_refused(tmp_path: Path, capsys) -> None:
    line = refused(tmp_path, capsys, text(sim()) + text(sim("chain"), model="other"), "--current", "32")
    assert "two models" in line


@pytest.mark.parametrize("label", ["016", "99999", "١٦", "１６", "16/cap4", str(MAX_BUDGET + 1), "+16"])
def test_labels_other_than_chain_or_a_decimal_budget_are_refused(tmp_path, capsys, label: str) -> None:
    counts = sim()
    counts["budgets"][label] = counts["budgets"].pop("16")
    line = refused(tmp_path, capsys, text(counts), "--current", "32")
    assert "counterfactual budget label" in line


def test_a_missing_counter_is_refused(tmp_path: Path, capsys) -> None:
    counts = sim()
    del counts["real_emitted_tokens_squared"]
    assert "missing" in refused(tmp_path, capsys, text(counts), "--current", "32")


# ------------------------------------------------------------------------- the server's own word


def test_the_running_setting_must_agree_with_the_real_rounds(tmp_path: Path, capsys) -> None:
    """A server running 16 says so; counters whose 16 candidate differs from the real rounds (a chain
    server's) are not this server's: refused, never an unpaired proposal."""
    counts = sim("chain")
    line = refused(tmp_path, capsys, text(counts), "--current", "16")
    assert 'accepted_tokens_total{budget="16"}' in line and "the server runs 16" in line
    with pytest.raises(EvidenceError, match="the server runs 16"):
        cf.read_counters(text(counts), horizon=HORIZON, running="16")
    cf.read_counters(text(counts), horizon=HORIZON, running="chain")  # what it does run


def test_tune_reads_the_running_setting_and_the_horizon_from_the_server(
    tmp_path, capsys, monkeypatch
) -> None:
    counts = sim("chain")
    info = {
        "speculative_algorithm": "DDTREE",
        "speculative_ddtree_budget": 16,
        "speculative_ddtree_topk_cap": None,
        "speculative_dflash_block_size": HORIZON + 1,
    }
    monkeypatch.setattr(cf, "fetch_metrics", lambda url, timeout: text(counts))
    monkeypatch.setattr("ddtree_runtime.health.sglang_client.server_info", lambda base, timeout: (200, info))
    code = main(["tune", "--url", "http://127.0.0.1:1", "--concurrency", "1", "--min-rounds", "50"])
    err = capsys.readouterr().err
    assert code == 2 and "the server runs 16" in err  # its word against its counters
    info.update(speculative_ddtree_budget=HORIZON, speculative_ddtree_topk_cap=1)  # it runs the chain
    assert (
        main(["tune", "--url", "http://127.0.0.1:1", "--concurrency", "1", "--min-rounds", "50", "--json"])
        == 0
    )
    rec = json.loads(capsys.readouterr().out)
    assert (rec["current"], rec["horizon"]) == ("chain", HORIZON)
    assert rec["current_source"] == "the server's /server_info"
    assert main(["tune", "--url", "http://127.0.0.1:1", "--horizon", "31"]) == 2  # against the server's block
    assert "drafter block is 16" in capsys.readouterr().err


# ------------------------------------------------------------------------- nothing to compare against


def test_no_known_current_setting_is_not_enough_evidence(tmp_path: Path, capsys) -> None:
    line = refused(tmp_path, capsys, text(sim()), code=1)
    assert "the setting this host runs is unknown" in line


def test_a_current_setting_the_counters_do_not_measure_is_not_enough_evidence(tmp_path, capsys) -> None:
    line = refused(tmp_path, capsys, text(sim()), "--current", "24", code=1)
    assert "the host runs 24, which the counters do not measure" in line
    counts = sim("chain")
    del counts["budgets"]["chain"]  # the host runs the chain, the chain is not scored
    line = refused(tmp_path, capsys, text(counts), "--current", "chain", code=1)
    assert "the host runs chain, which the counters do not measure" in line


@pytest.mark.parametrize("current", ["016", "sixteen", "0", "Chain", str(MAX_BUDGET + 1)])
def test_a_current_that_is_not_a_setting_is_bad_input(tmp_path: Path, capsys, current: str) -> None:
    assert "--current" in refused(tmp_path, capsys, text(sim()), "--current", current)


def test_a_cost_table_without_the_running_setting_is_not_enough_evidence(tmp_path: Path, capsys) -> None:
    table = tmp_path / "partial.json"
    table.write_text(json.dumps({k: v for k, v in TABLE.items() if k != "32"}))
    line = refused(tmp_path, capsys, text(sim()), "--current", "32", "--round-ms-json", str(table), code=1)
    assert "no cost for 32, the setting that runs" in line
    table.write_text(json.dumps({**TABLE, "016": {"1": 20.0}}))
    assert "--round-ms-json setting" in refused(
        tmp_path, capsys, text(sim()), "--current", "32", "--round-ms-json", str(table)
    )


def test_a_fresh_server_with_every_counter_at_zero_is_not_enough_evidence(tmp_path, capsys) -> None:
    counts = sim()
    zero = {k: 0 for k in counts if k != "budgets"}
    zero["budgets"] = {label: dict.fromkeys(c, 0) for label, c in counts["budgets"].items()}
    line = refused(tmp_path, capsys, text(zero), "--current", "32", code=1)
    assert "only 0 rounds scored" in line


# ------------------------------------------------------------------------- settings that cannot run


def test_a_budget_above_the_validated_limit_is_never_proposed(tmp_path: Path, capsys) -> None:
    """However well 64 would do (priced as cheap as 16 here), it is above 32, the largest budget shown
    lossless on the H200 with CUDA graphs: left out, and the best runnable setting is proposed."""
    table = tmp_path / "cheap64.json"
    table.write_text(json.dumps({**TABLE, "64": {"1": 21.0}}))
    code, out, err = tune(tmp_path, capsys, text(sim()), "--current", "32", "--round-ms-json", str(table))
    assert code == 0, err
    rec = json.loads(out)
    rows = {r["setting"]: r for r in rec["table"]}
    assert rows["64"]["tokens_per_s"] == max(r["tokens_per_s"] for r in rec["table"])
    assert (
        "above 32" in rows["64"]["left_out"] and rec["recommended"] != "64" and rec["best_runnable"] != "64"
    )
    assert rec["host_vars"]["sglang_service_flag_overrides"]["speculative-ddtree-budget"] != 64


def test_without_a_plan_only_settings_needing_no_more_memory_are_proposed(tmp_path, capsys) -> None:
    """A chain server whose counters favour 16: 16 needs a wider KV window than the chain (17 > 16), so
    without ddtree plan's inputs it is left out, and the table says why."""
    cheap = tmp_path / "cheap.json"
    cheap.write_text(json.dumps({k: {"1": 20.0} for k in TABLE}))
    code, out, _ = tune(
        tmp_path, capsys, text(sim("chain")), "--current", "chain", "--round-ms-json", str(cheap)
    )
    rec = json.loads(out)
    rows = {r["setting"]: r for r in rec["table"]}
    assert code == 0 and "its fit is not planned" in rows["16"]["left_out"] and rows["8"]["left_out"] is None
    assert rec["recommended"] in ("chain", "8")


def test_a_setting_that_does_not_fit_the_host_is_never_proposed(tmp_path, capsys, qwen36_models_json) -> None:
    """Budget 32 at balanced's 16 running requests with fp32 state on one H200: ddtree plan says it does
    not fit (docs/bench/profile-choice.md), so however well 32 would accept, 16 is what is proposed."""
    counts = sim("16")
    table = tmp_path / "cheap32.json"
    table.write_text(json.dumps({**TABLE, "32": {"1": 21.0}}))  # 32 priced as 16: it would win on tokens
    code, out, err = tune(
        tmp_path,
        capsys,
        text(counts),
        "--current",
        "16",
        "--round-ms-json",
        str(table),
        "--models-json",
        str(qwen36_models_json),
        "--profile",
        "balanced",
    )
    assert code == 0, err
    rec = json.loads(out)
    rows = {r["setting"]: r for r in rec["table"]}
    assert (
        "does not fit 1xH200" in rows["32"]["left_out"]
        and rows["32"]["tokens_per_s"] > rows["16"]["tokens_per_s"]
    )
    assert rows["chain"]["left_out"] is None and rows["8"]["left_out"] is None
    assert rec["recommended"] != "32" and rec["best_runnable"] != "32"
    assert (rec["current_source"], rec["fit"]) == ("--current", "ddtree plan (--models-json)")


# ------------------------------------------------------------------------- messages and limits


def test_binary_input_gets_one_printable_line(tmp_path: Path, capsys) -> None:
    line = refused(tmp_path, capsys, bytes(range(256)) * 4, "--current", "32")
    assert "not UTF-8" in line


def test_input_above_the_limit_is_refused_not_cut(tmp_path: Path, capsys, monkeypatch) -> None:
    body = text(sim())
    big = body + "# " + "x" * (16 * 1024 * 1024) + "\n"  # valid counters first, then 16 MiB more
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(big.encode())))
    code = main(
        [
            "tune",
            "--metrics-file",
            "-",
            "--current",
            "32",
            "--horizon",
            str(HORIZON),
            "--min-rounds",
            "50",
            "--propose",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "more than 16 MiB" in err


# ------------------------------------------------------------------------- fuzz


def _corruptions(counts: dict, rng: random.Random) -> tuple[str, dict | str, list[str]]:
    """One random corruption of valid counters that no scorer can emit: (name, counts or text, extra args)."""
    c = copy.deepcopy(counts)
    n, labels = m(c), list(c["budgets"])
    label = rng.choice(labels)
    field = rng.choice(
        ["accepted_tokens", "accepted_tokens_squared", "round_weight", "accepted_tokens_x_real"]
    )
    rounds = rng.choice([k for k in c if k != "budgets"])
    kind = rng.randrange(16)
    if kind == 0:
        c["budgets"][label][field] = rng.choice([math.nan, math.inf, -math.inf])
    elif kind == 1:
        c[rounds] = -rng.randint(1, 10**6)
    elif kind == 2:
        c["budgets"][label][field] = rng.uniform(2.0**53, 1e300)
    elif kind == 3:
        c["budgets"][label][rng.choice(["accepted_tokens", "accepted_tokens_x_real"])] += 0.5
    elif kind == 4:
        c["budgets"][label]["accepted_tokens"] = _bound(c, label) + rng.randint(1, 10**4)
    elif kind == 5:
        c["rounds_sampled"] = n + c["rounds_dropped"] + c["rounds_discarded"] - rng.randint(1, n)
    elif kind == 6:
        c["real_emitted_tokens"] = rng.randint(0, n - 1)
    elif kind == 7:
        per_round = HORIZON if label == "chain" else min(int(label), HORIZON)
        c["budgets"][label]["round_weight"] = (
            c["real_emitted_tokens"] / (per_round + 1) * rng.uniform(0, 0.99)
        )
    elif kind == 8:
        a = c["budgets"][label]["accepted_tokens"]
        if a == 0:
            c["budgets"][label]["accepted_tokens_squared"] = rng.randint(1, 10**6)  # squares of zeros
        else:
            c["budgets"][label]["accepted_tokens_squared"] = math.ceil(a * a / n) - rng.randint(1, a)
    elif kind == 9:
        c["budgets"][label]["accepted_tokens_x_real"] = (HORIZON + 1) * c["budgets"][label][
            "accepted_tokens"
        ] + rng.randint(1, 999)
    elif kind == 10:
        trees = [t for t in labels if t != "chain"]
        small, large = sorted(rng.sample(trees, 2), key=int)
        if c["budgets"][small]["accepted_tokens"] == c["budgets"][large]["accepted_tokens"]:
            c["budgets"][large]["accepted_tokens_squared"] = (
                c["budgets"][small]["accepted_tokens_squared"] - 1
            )
        else:
            c["budgets"][small], c["budgets"][large] = c["budgets"][large], c["budgets"][small]
    elif kind == 11:
        body = text(c).splitlines()
        return "duplicate line", "\n".join([*body, rng.choice(body)]) + "\n", []
    elif kind == 12:
        return "two models", text(c) + text(c, model="other"), []
    elif kind == 13:
        bad = rng.choice(
            ["0" + label if label != "chain" else "CHAIN", "99999", "١٦", "16/cap4", " 8", "8.0"]
        )
        if bad not in c["budgets"]:
            c["budgets"][bad] = c["budgets"].pop(label)
        else:
            c["budgets"]["016"] = c["budgets"].pop(label)
    elif kind == 14:
        if rng.random() < 0.5:
            del c[rounds]
        else:
            del c["budgets"][label][field]
    else:  # a claimed running setting the counters contradict: accepted + 1 differs from the real rounds
        others = [t for t in labels if c["budgets"][t]["accepted_tokens"] + n != c["real_emitted_tokens"]]
        return "claimed running", c, ["--current", rng.choice(others)]
    return f"corruption {kind}", c, []


def test_random_corruptions_of_valid_counters_never_yield_a_proposal(tmp_path: Path, capsys) -> None:
    rng = random.Random(43)
    counts = sim("32")
    assert tune(tmp_path, capsys, text(counts), "--current", "32")[0] == 0  # valid: acted on
    kinds = set()
    for _ in range(120):
        name, bad, extra = _corruptions(counts, rng)
        kinds.add(name)
        body = bad if isinstance(bad, str) else text(bad)
        code, out, err = tune(tmp_path, capsys, body, "--current", "32", *extra)
        assert code == 2 and out == "", (name, code, err, out[:200])
        assert err.count("\n") == 1 and err.strip().isprintable(), (name, err)
    assert len(kinds) == 16  # every kind of corruption was drawn


# ------------------------------------------------------------------------- the router layer


def _workers(*entries: tuple[str, str]) -> list[dict]:
    return [{"id": wid, "url": url, "is_healthy": True} for wid, url in entries]


def test_a_router_answer_with_a_worker_id_twice_is_refused_before_anyone_is_removed(
    capsys, monkeypatch
) -> None:
    from ddtree_runtime.ops import rotation

    doc = {
        "host": "ct129",
        "urls": ["http://10.0.0.1:30000"],
        "batch_addresses": [],
        "restart_bound_s": 60,
        "routers": [
            {
                "name": "r1",
                "members": [
                    {"host": "ct129", "address": "10.0.0.1"},
                    {"host": "ct130", "address": "10.0.0.2"},
                ],
                "workers": _workers(("w1", "http://10.0.0.1:30000"), ("w2", "http://10.0.0.2:30000")),
            }
        ],
    }

    def leave(d: dict) -> tuple[int, dict]:
        monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(d)))
        code = rotation.main(["leave"])
        return code, json.loads(capsys.readouterr().out)

    code, answer = leave(doc)
    assert code == 0 and [r["id"] for r in answer["removals"]] == ["w1"]
    doc["routers"][0]["workers"] = _workers(("w1", "http://10.0.0.1:30000"), ("w1", "http://10.0.0.2:30000"))
    code, answer = leave(doc)
    assert code == rotation.EXIT_BAD_INPUT and "removals" not in answer
    assert "share the id 'w1'" in answer["reason"]
    doc["routers"][0]["workers"] = _workers(("w1", "http://10.0.0.1:30000"), ("w2", "HTTP://10.0.0.1:30000/"))
    code, answer = leave(doc)
    assert code == rotation.EXIT_BAD_INPUT and "listed twice" in answer["reason"]


def test_non_finite_canary_traffic_counters_are_bad_input(capsys, monkeypatch) -> None:
    from ddtree_runtime.ops import canary_traffic

    live, shadow = "http://10.0.0.1:30000", "http://10.0.0.1:30001"

    def router(ok: dict[str, Any]) -> str:
        return "".join(
            f'smg_worker_cb_outcomes_total{{worker="{u}",outcome="success"}} {v}\n'
            f'smg_worker_cb_outcomes_total{{worker="{u}",outcome="failure"}} 0\n'
            for u, v in ok.items()
        )

    def engine(n: int, total: Any) -> str:
        name = "sglang:e2e_request_latency_seconds"
        buckets = f'{name}_bucket{{le="0.1"}} {n}\n{name}_bucket{{le="+Inf"}} {n}\n'
        return f"{buckets}{name}_count {n}\n{name}_sum {total}\n"

    doc = {
        "live_url": live,
        "shadow_url": shadow,
        "routers_before": [router({live: 100, shadow: 0})],
        "routers_after": [router({live: 160, shadow: 30})],
        "live_before": engine(100, 7.0),
        "live_after": engine(160, 11.0),
        "shadow_before": engine(0, 0.0),
        "shadow_after": engine(30, 2.0),
        "window_s": 10,
        "thresholds": {"min_requests": 20},
    }

    def verdict(d: dict) -> tuple[int, dict]:
        monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(d)))
        code = canary_traffic.main()
        return code, json.loads(capsys.readouterr().out)

    assert verdict(doc)[0] == canary_traffic.EXIT_PROMOTE
    for over in (
        {"shadow_after": engine(30, "NaN")},
        {"routers_after": [router({live: 160, shadow: "NaN"})]},
        {"live_after": engine(160, "+Inf")},
    ):
        code, report = verdict({**doc, **over})
        assert code == canary_traffic.EXIT_BAD_INPUT and report["verdict"] == "abort", report
        assert re.search(r"is not a finite number", report["reason"]), report["reason"]


def test_labels_refuse_with_one_line_naming_the_value() -> None:
    from ddtree_runtime.core.decoder_settings import parse_label

    with pytest.raises(SettingsError) as exc:
        parse_label("\x1b[31m16", what="label")
    assert str(exc.value).isprintable() and "\\x1b" in str(exc.value)


def test_a_message_carrying_control_characters_stays_one_printable_line(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "scrape\n\x1b[31mred\x00.txt"
    assert main(["tune", "--metrics-file", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.strip().isprintable() and "\\x1b" in err, err


def test_a_server_that_does_not_say_what_it_runs_leaves_no_current(tmp_path, capsys, monkeypatch) -> None:
    info = {
        "speculative_algorithm": "DDTREE",
        "speculative_ddtree_budget": 7,
        "speculative_ddtree_topk_cap": 1,
        "speculative_dflash_block_size": HORIZON + 1,
    }  # a capped tree no label names
    monkeypatch.setattr(cf, "fetch_metrics", lambda url, timeout: text(sim("chain")))
    monkeypatch.setattr("ddtree_runtime.health.sglang_client.server_info", lambda base, timeout: (200, info))
    assert main(["tune", "--url", "http://127.0.0.1:1", "--concurrency", "1", "--min-rounds", "50"]) == 1
    assert (
        "unknown (the server's /server_info does not say (it runs budget 7 with top-K cap 1"
        in capsys.readouterr().err
    )


def test_a_fit_needs_the_profile_it_is_planned_at(tmp_path: Path, capsys, qwen36_models_json) -> None:
    line = refused(tmp_path, capsys, text(sim()), "--current", "32", "--models-json", str(qwen36_models_json))
    assert "--models-json needs --profile" in line


def test_record_counterfactual_stores_only_counters_that_can_be_true(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """`ddtree metrics record-counterfactual` checks what it stores (with the server's running setting and
    horizon), and the exporter skips, and names, a stored file that fails the checks."""
    counts = sim("chain")
    info = {"speculative_algorithm": "DFLASH", "speculative_dflash_block_size": HORIZON + 1}
    scrape = {"text": text(counts)}
    monkeypatch.setattr(cf, "fetch_metrics", lambda url, timeout: scrape["text"])
    monkeypatch.setattr("ddtree_runtime.health.sglang_client.server_info", lambda base, timeout: (200, info))
    root = tmp_path / "state"
    record = ["metrics", "record-counterfactual", "--state-dir", str(root), "--url", "http://127.0.0.1:1"]
    assert main([*record, "--unit", "sglang-qwen"]) == 0
    stored = json.loads((root / "counterfactual" / "sglang-qwen.json").read_text())
    assert (stored["horizon"], stored["running"], stored["counts"]) == (HORIZON, "chain", counts)
    bad = copy.deepcopy(counts)
    bad["budgets"]["16"]["accepted_tokens"] = _bound(bad, "16") + 1
    scrape["text"] = text(bad)
    assert main([*record, "--unit", "sglang-qwen-shadow"]) == 2
    assert 'accepted_tokens_total{budget="16"}' in capsys.readouterr().err
    assert not (root / "counterfactual" / "sglang-qwen-shadow.json").exists()
    # A stored file forged after the fact: its series are skipped and the file named, the rest served.
    (root / "counterfactual" / "sglang-qwen-shadow.json").write_text(json.dumps({**stored, "counts": bad}))
    assert main(["metrics", "show", "--state-dir", str(root), "--no-systemd"]) == 0
    out, err = capsys.readouterr()
    assert 'ddtree_counterfactual_rounds_scored_total{unit="sglang-qwen"}' in out
    series = [ln for ln in out.splitlines() if ln.startswith("ddtree_counterfactual_")]
    assert series and not [ln for ln in series if 'unit="sglang-qwen-shadow"' in ln]
    assert "counterfactual/sglang-qwen-shadow.json" in err
