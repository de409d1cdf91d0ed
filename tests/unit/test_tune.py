"""`ddtree tune`: the counters parsed from a server's /metrics (as the lab server renders them), the
estimates' arithmetic, the round-cost model, the pick with its uncertainty, the host_vars proposal, and
clear refusals (too few rounds, no counters, bad input)."""

from __future__ import annotations

import http.server
import json
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from ddtree_runtime.cli import main
from ddtree_runtime.health import counterfactual_counters as cf
from ddtree_runtime.planner import tune
from ddtree_runtime.tiny_engine.serving_metrics import ServingMetrics


def _snapshot(rounds: int, cands: dict[str, tuple[int, int, float, int]], real: int, real_sq: int) -> dict:
    """cands: label -> (accepted, accepted squared, round weight, accepted x real tokens)."""
    return {
        "rounds_scored": rounds, "rounds_sampled": rounds + 3, "rounds_dropped": 1, "rounds_discarded": 2,
        "pending": 0, "real_emitted": real, "real_emitted_sq": real_sq,
        "candidates": [{"label": k, "accepted": a, "accepted_sq": q, "round_weight": w, "accepted_x_real": x}
                       for k, (a, q, w, x) in cands.items()],
    }  # fmt: skip


def _metrics_text(snap: dict) -> str:
    """What the lab server's /metrics says for this snapshot (the real collector and registry)."""
    m = ServingMetrics("lab", counterfactual=lambda: snap)
    m.num_running_reqs.set(3)
    return m.render().decode()


# 400 rounds; the chain accepted 1 token per round (all rounds alike), budget 16 accepted 2 on half the
# rounds and 4 on the other half; the real server (running the chain) emitted 2 tokens a round.
B16 = (1200, 200 * 4 + 200 * 16, 200 * 2 / 3 + 200 * 2 / 5, 2 * 1200)  # accepted, squares, weight, x real
SNAP = _snapshot(400, {"chain": (400, 400, 400.0, 800), "16": B16}, 800, 400 * 4)


def test_the_counters_parse_back_and_the_estimates_follow_from_them() -> None:
    counts = cf.read_counters(_metrics_text(SNAP), horizon=15, running="chain")
    assert counts.rounds_scored == 400 and counts.real_emitted_tokens == 800
    assert counts.rounds_dropped == 1 and counts.rounds_discarded == 2
    assert counts.candidates["16"].accepted_tokens == 1200
    chain, b16 = cf.estimates(counts)
    assert (chain.label, chain.budget, b16.budget) == ("chain", None, 16)
    assert chain.mean_accepted == 1 and chain.sd_accepted == 0 and chain.tokens_per_round == pytest.approx(2)
    assert b16.mean_accepted == 3
    assert b16.sd_accepted == pytest.approx(math.sqrt(1 * 400 / 399))  # values 2 and 4 half each
    # Renewal: 800 tokens over 200 x 2/3 + 200 x 2/5 rounds.
    assert b16.tokens_per_round == pytest.approx(800 / (200 * 2 / 3 + 200 * 2 / 5))
    assert b16.tokens_per_round_se == pytest.approx(b16.tokens_per_round * (b16.sd_accepted / 20) / 4)
    # Paired with the running chain, round by round: d = (a + 1) - 2 is 1 or 3, half each.
    assert chain.running and (chain.paired_mean, chain.paired_se) == (0, 0)
    assert not b16.running and b16.paired_mean == pytest.approx(2)
    assert b16.paired_se == pytest.approx(math.sqrt(400 / 399 / 400))


def test_text_without_counters_or_with_broken_ones_is_refused() -> None:
    with pytest.raises(cf.NoCounterfactual, match="counterfactual-fraction"):
        cf.parse_metrics(ServingMetrics("lab").render().decode())
    with pytest.raises(cf.EvidenceError, match="finite"):
        cf.read_counters(_metrics_text(SNAP).replace(" 400.0\n", " NaN\n", 1))
    with pytest.raises(ValueError, match="budget label"):
        cf.parse_metrics("sglang:ddtree_counterfactual_rounds_scored_total 3\n"
                         "sglang:ddtree_counterfactual_accepted_tokens_total 3\n")  # fmt: skip


def test_the_round_cost_model_is_the_measured_h200_figures_and_a_stated_scaling_elsewhere() -> None:
    # docs/bench/prod-shape.md, "Overlapped trees" (repeat 1): one request's decode round at concurrency 1,
    # running requests x 1.016 / tok/s at 4 and 16 (both servers held 16).
    chain1, tree1 = 22.853, 23.966
    assert tune.round_ms("chain", 1) == pytest.approx(chain1, abs=1e-3)
    assert tune.round_ms("16", 1) == pytest.approx(tree1, abs=1e-3)
    assert tune.round_ms("chain", 16) == pytest.approx(16 * 1.016 / 308.65 * 1e3)
    assert tune.round_ms("16", 16) == pytest.approx(16 * 1.016 / 261.8 * 1e3)
    assert tune.round_ms("8", 4) == tune.round_ms("16", 4)  # not measured: priced as 16
    assert tune.round_ms("64", 1) == pytest.approx(tree1 + 8.51, abs=1e-3)  # + the GDN verify's extra rows
    assert tune.round_ms("32", 1) == pytest.approx(tree1 + 8.51 / 3, abs=1e-3)
    mid = tune.round_ms("chain", 10)  # between the measured 4 and 16
    assert tune.round_ms("chain", 4) < mid < tune.round_ms("chain", 16)
    scale = 4.8 / (0.768 * 2)
    assert tune.round_ms("chain", 1, gpu="A6000", tp=2) == pytest.approx(chain1 * scale, abs=1e-2)
    host = tree1 - chain1  # a tree round's host time beyond the chain's, kept as is
    assert abs(tune.TREE_HOST_GAP_MS - host) < 1e-3
    assert tune.round_ms("16", 1, gpu="A6000", tp=2) == pytest.approx((tree1 - host) * scale + host, abs=1e-2)
    with pytest.raises(ValueError, match="no cost model"):
        tune.round_ms("16", 1, gpu="B200")


def test_the_pick_weighs_acceptance_against_round_cost_and_its_noise() -> None:
    settings = [tune.Setting("chain", 2.0, 0.02), tune.Setting("16", 3.0, 0.03)]
    rec = tune.recommend(settings, concurrency=1, current="chain", rounds=400)
    # 3 / 24.0 ms against 2 / 22.9 ms: the tree wins by 43 % at one request on the H200.
    assert rec["recommended"] == "16" and rec["change"]
    assert rec["gain"] == pytest.approx((3 / tune.round_ms("16", 1)) / (2 / tune.round_ms("chain", 1)) - 1)
    assert rec["gain"] == pytest.approx(0.43, abs=0.01)
    assert rec["gain_se"] == pytest.approx((1 + rec["gain"]) * math.hypot(0.01, 0.01))
    # The same gain with fifteen times the noise is not two standard errors clear: keep the chain.
    noisy = [tune.Setting("chain", 2.0, 0.3), tune.Setting("16", 3.0, 0.45)]
    rec = tune.recommend(noisy, concurrency=1, current="chain", rounds=400)
    assert rec["recommended"] == "chain" and not rec["change"]
    # A tree that accepts only 1.05x the chain loses to the chain's cheaper round (1.10x at 4 requests).
    rec = tune.recommend([tune.Setting("chain", 2.0, 0.01), tune.Setting("16", 2.1, 0.01)], concurrency=4,
                         current="16", rounds=400)  # fmt: skip
    assert rec["recommended"] == "chain" and rec["change"] and rec["gain"] > 0
    # Measured on the same rounds as the running chain, the difference's own noise decides: the same
    # noisy figures, paired with a small spread of the difference, clear the bar.
    paired = [tune.Setting("chain", 2.0, 0.3, 0.0, running=True), tune.Setting("16", 3.0, 0.45, 0.03)]
    rec = tune.recommend(paired, concurrency=1, current="chain", rounds=400)
    assert rec["recommended"] == "16" and rec["change"] and rec["gain_se_method"] == "paired"
    assert rec["gain_se"] == pytest.approx((1 + rec["gain"]) * 0.03 / 3.0)
    # Pairing needs the current setting to be the one the server ran: otherwise independent errors.
    rec = tune.recommend([tune.Setting("chain", 2.0, 0.3, 0.5), tune.Setting("16", 3.0, 0.45, 0.03)],
                         concurrency=1, current="chain", rounds=400)  # fmt: skip
    assert rec["gain_se_method"] == "independent" and not rec["change"]
    with pytest.raises(tune.TooFewRounds, match="only 199 rounds"):
        tune.recommend(settings, concurrency=1, current="chain", rounds=199)
    assert tune.flag_overrides("chain") == {"speculative-ddtree-budget": 15, "speculative-ddtree-topk-cap": 1}
    assert tune.flag_overrides("32") == {"speculative-ddtree-budget": 32, "speculative-ddtree-topk-cap": None}


def test_the_verb_proposes_the_host_vars_change_and_writes_nothing(
    tmp_path: Path, capsys, qwen36_models_json: Path
) -> None:
    scrape = tmp_path / "metrics.txt"
    scrape.write_text(_metrics_text(SNAP))
    before = sorted(tmp_path.iterdir())
    # Budget 16 needs a wider KV window than the chain: only ddtree plan's fit (balanced on one H200) lets
    # it be proposed.
    plan = ["--models-json", str(qwen36_models_json), "--profile", "balanced"]
    code = main(["tune", "--metrics-file", str(scrape), "--current", "chain", "--concurrency", "1",
                 "--propose", "--json", *plan])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and sorted(tmp_path.iterdir()) == before
    # 3.08 tokens a round at 24.0 ms against 2 at 22.9 ms.
    assert out["recommended"] == "16" and out["change"]
    assert out["host_vars"] == {
        "sglang_service_flag_overrides": {
            "speculative-ddtree-budget": 16,
            "speculative-ddtree-topk-cap": None,
        }
    }
    code = main(["tune", "--metrics-file", str(scrape), "--current", "chain", "--propose", *plan])
    text = capsys.readouterr().out
    assert code == 0 and "recommend: 16 instead of chain" in text and "speculative-ddtree-budget: 16" in text
    assert "concurrency 3 (sglang:num_running_reqs" in text  # no --concurrency: the scrape's gauge


def test_the_verb_refuses_too_few_rounds_missing_counters_and_bad_input(tmp_path: Path, capsys) -> None:
    few = tmp_path / "few.txt"
    few.write_text(_metrics_text(_snapshot(20, {"chain": (20, 20, 20.0, 40)}, 40, 80)))
    assert main(["tune", "--metrics-file", str(few)]) == 1
    assert "only 20 rounds scored; 200 are needed" in capsys.readouterr().err
    none = tmp_path / "none.txt"
    none.write_text(ServingMetrics("lab").render().decode())
    assert main(["tune", "--metrics-file", str(none)]) == 1
    assert "no sglang:ddtree_counterfactual_" in capsys.readouterr().err
    good = tmp_path / "good.txt"
    good.write_text(_metrics_text(SNAP))
    bad_table = tmp_path / "t.json"
    bad_table.write_text('{"chain": {"0": 20}}')
    assert main(["tune", "--metrics-file", str(good), "--round-ms-json", str(bad_table)]) == 2
    assert "concurrency 1..4096" in capsys.readouterr().err
    assert main(["tune", "--metrics-file", str(tmp_path)]) == 2  # a directory
    assert "not a regular file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "--metrics-file", str(good), "--concurrency", "0"])


class _Fake(http.server.BaseHTTPRequestHandler):
    info: ClassVar[dict] = {}
    metrics: ClassVar[str] = ""

    def do_GET(self) -> None:
        body = (json.dumps(self.info) if self.path == "/server_info" else self.metrics).encode()
        self.send_response(200 if self.path in ("/server_info", "/metrics") else 404)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def fake_server() -> Iterator[str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()


def test_the_verb_reads_a_server_and_its_current_setting(fake_server: str, capsys) -> None:
    _Fake.metrics = _metrics_text(SNAP)
    _Fake.info = {"speculative_algorithm": "DDTREE", "speculative_ddtree_budget": 15,
                  "speculative_ddtree_topk_cap": 1, "speculative_dflash_block_size": 16}  # fmt: skip
    assert main(["tune", "--url", fake_server, "--concurrency", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["current"] == "chain" and out["best_runnable"] == "chain"  # 16 not planned: left out
    # A server that says it runs 16 while these counters' 16 differs from its real rounds: refused.
    _Fake.info = {"speculative_algorithm": "DDTREE", "speculative_ddtree_budget": 16,
                  "speculative_dflash_block_size": 16}  # fmt: skip
    assert main(["tune", "--url", fake_server, "--concurrency", "1", "--json"]) == 2
    assert "the server runs 16" in capsys.readouterr().err
    assert main(["tune", "--url", "http://127.0.0.1:1", "--timeout", "2"]) == 3
    assert "ddtree tune:" in capsys.readouterr().err


def test_the_exporter_serves_the_estimate_per_budget(fake_server: str, tmp_path: Path, capsys) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    _Fake.metrics = _metrics_text(SNAP)
    _Fake.info = {"speculative_algorithm": "DFLASH", "speculative_dflash_block_size": 16}
    root = tmp_path / "state"
    unit = "sglang-qwen.service"
    assert main(["metrics", "record-counterfactual", "--state-dir", str(root), "--unit", unit,
                 "--url", fake_server]) == 0  # fmt: skip
    assert main(["metrics", "show", "--state-dir", str(root), "--no-systemd"]) == 0
    samples = {
        (s.name, s.labels.get("unit"), s.labels.get("budget")): s.value
        for fam in text_string_to_metric_families(capsys.readouterr().out)
        for s in fam.samples
    }
    assert samples[("ddtree_counterfactual_rounds_scored_total", "sglang-qwen", None)] == 400
    assert samples[("ddtree_counterfactual_accepted_tokens_total", "sglang-qwen", "16")] == 1200
    assert samples[("ddtree_counterfactual_tokens_per_round", "sglang-qwen", "chain")] == pytest.approx(2.0)
    b16 = cf.estimates(cf.read_counters(_Fake.metrics))[1]
    assert samples[("ddtree_counterfactual_tokens_per_round", "sglang-qwen", "16")] == pytest.approx(
        b16.tokens_per_round
    )
    assert samples[("ddtree_counterfactual_tokens_per_round_stderr", "sglang-qwen", "16")] == pytest.approx(
        b16.tokens_per_round_se
    )
    # A broken state file costs only its own series, and is named.
    (root / "counterfactual" / "sglang-qwen.json").write_text('{"counts": {"rounds_scored": -1}}')
    assert main(["metrics", "show", "--state-dir", str(root), "--no-systemd"]) == 0
    captured = capsys.readouterr()
    assert "ddtree_counterfactual_tokens_per_round{" not in captured.out
    assert "counterfactual/sglang-qwen.json" in captured.err
    # A server without the counters: a one-line refusal, nothing stored.
    _Fake.metrics = ServingMetrics("lab").render().decode()
    assert main(["metrics", "record-counterfactual", "--state-dir", str(root), "--unit", "u2",
                 "--url", fake_server]) == 2  # fmt: skip
    assert "no sglang:ddtree_counterfactual_" in capsys.readouterr().err
    assert not (root / "counterfactual" / "u2.json").exists()


# An adaptive server (issue 41): auto(15,31) on block 16, the counters scoring the chain and budgets 15,
# 16 and 31 (the trees alike), its width state in /server_info and its width series on /metrics.
ADAPTIVE_SNAP = _snapshot(400, {"chain": (400, 400, 400.0, 800), "15": B16, "16": B16, "31": B16}, 800, 1600)
WIDTH_STATE = {"widths": ["15", "31"], "exploring": False,
               "table": {"1": "15", "2": "15", "4": "15", "8": "31", "16": "31"},
               "tokens_per_round": {"15": 4.1, "31": 5.02}, "observed_rows": {"15": 300, "31": 260},
               "rounds": {"15": 120, "31": 80}}  # fmt: skip
ADAPTIVE_INFO = {"speculative_algorithm": "DDTREE", "speculative_ddtree_budget": 31,
                 "speculative_ddtree_widths": [15, 31], "speculative_dflash_block_size": 16,
                 "internal_states": [{"ddtree_widths": WIDTH_STATE}]}  # fmt: skip
WIDTH_SERIES = ("# TYPE sglang:ddtree_width_rounds_total counter\n"
                'sglang:ddtree_width_rounds_total{width="15"} 120\n'
                'sglang:ddtree_width_rounds_total{width="31"} 80\n'
                "# TYPE sglang:ddtree_width_tokens_per_round gauge\n"
                'sglang:ddtree_width_tokens_per_round{width="31"} 5.5\n')  # fmt: skip


def test_an_adaptive_server_has_no_one_setting_and_still_gets_the_table(fake_server: str, capsys) -> None:
    _Fake.metrics = _metrics_text(ADAPTIVE_SNAP) + WIDTH_SERIES
    _Fake.info = ADAPTIVE_INFO
    assert main(["tune", "--url", fake_server, "--concurrency", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["current"] is None and out["recommended"] is None and out["change"] is False
    assert out["gain"] is None and [r["setting"] for r in out["table"]] == ["chain", "15", "16", "31"]
    assert out["best_runnable"] == "15"  # 15 and 16 tie on these counters; the first wins
    assert out["adaptive"]["setting"] == "auto(15,31)" and out["adaptive"]["widths"] == ["15", "31"]
    assert out["adaptive"]["state"]["per_batch_size"] == "1-4:15 8-16:31"
    assert main(["tune", "--url", fake_server, "--concurrency", "1", "--propose"]) == 0
    text = capsys.readouterr().out
    assert "runs now: adaptive widths auto(15,31) (the server's /server_info)" in text
    assert ("its widths (/server_info ddtree_widths): width per batch size 1-4:15 8-16:31; 15: 120 rounds, "
            "4.100 tok/round; 31: 80 rounds, 5.020 tok/round") in text
    assert text.count("<- one of its widths") == 2 and "<- runs now" not in text
    assert "no one setting runs and nothing is compared; the best single setting here is 15" in text
    assert "host_vars: no change proposed" in text
    # Without the state in /server_info, the /metrics series say what they can.
    _Fake.info = {k: v for k, v in ADAPTIVE_INFO.items() if k != "internal_states"}
    assert main(["tune", "--url", fake_server, "--concurrency", "1"]) == 0
    assert ("its widths (/metrics sglang:ddtree_width_*): 15: 120 rounds, not yet observed; 31: 80 rounds, "
            "5.500 tok/round") in capsys.readouterr().out
    # A malformed state is a bad answer (exit 2), as a malformed price table is.
    _Fake.info = {**ADAPTIVE_INFO, "internal_states": [{"ddtree_widths": {**WIDTH_STATE, "exploring": "no"}}]}
    assert main(["tune", "--url", fake_server, "--concurrency", "1"]) == 2
    assert "internal_states[0].ddtree_widths.exploring is 'no'" in capsys.readouterr().err


def test_runnable_and_recommend_take_adaptive_widths_for_the_setting_that_runs() -> None:
    from ddtree_runtime.core.decoder_settings import DecoderSettings

    auto = DecoderSettings.resolve("auto", 16)
    left = tune.runnable(["chain", "16", "31", "64"], current=None, horizon=15, runs=auto)
    assert left["chain"] is None and left["16"] is None and left["31"] is None  # within its widest window
    assert "above 32" in left["64"]
    with pytest.raises(ValueError, match="needs the setting that runs"):
        tune.runnable(["16"], current=None, horizon=15)
    rows = [tune.Setting("chain", 2.0, 0.0), tune.Setting("16", 3.0, 0.1)]
    rec = tune.recommend(rows, concurrency=1, current=None, rounds=400, adaptive=auto, left_out=left)
    assert (rec["current"], rec["recommended"], rec["change"]) == (None, None, False)
    assert rec["best_runnable"] == "16" and rec["gain"] is None
    with pytest.raises(tune.NoComparison):
        tune.recommend(rows, concurrency=1, current=None, rounds=400)  # neither a label nor widths
    with pytest.raises(tune.TooFewRounds):
        tune.recommend(rows, concurrency=1, current=None, rounds=20, adaptive=auto)


def test_a_profile_running_auto_is_adaptive_too(tmp_path: Path, capsys) -> None:
    scrape = tmp_path / "metrics.txt"
    scrape.write_text(_metrics_text(ADAPTIVE_SNAP))
    profiles = tmp_path / "profiles.yml"
    profiles.write_text("sglang_service_profiles:\n  trial:\n    flags: {speculative-ddtree-budget: auto}\n")
    assert main(["tune", "--metrics-file", str(scrape), "--profile", "trial", "--profiles", str(profiles),
                 "--concurrency", "1"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "runs now: adaptive widths auto(15,31) (profile trial)" in text
    assert "its widths: no figures published" in text
