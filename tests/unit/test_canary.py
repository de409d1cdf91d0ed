"""`ddtree canary compare` against real lab-engine servers on loopback (`ddtree tiny-engine serve`).

Four servers on a pair made to agree (`tests/sglang/_agreeing_pair.py`: the target always continues
with one word, the drafter proposes it at every depth), so every figure the checks compare is known
before the run instead of resting on what the trained lab models happen to accept: live (DDTree budget
16: the whole depth of 15 drafts a round), a shadow with a smaller budget (12: 12 drafts a round), a
shadow whose pair agrees on another word (other T=0 tokens from the first one), and a plain server
without speculative decoding and a short context. The thresholds' arithmetic is checked on hand-made
figures too.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator

import pytest

from ddtree_runtime.health import canary
from ddtree_runtime.health.canary import Answer, CanaryInputError, Side, SideUnavailable, Thresholds
from tests.sglang._agreeing_pair import write_agreeing_pair
from tests.unit._tiny_engine import free_port, lab_models
from tests.unit._tiny_server import TinyServerProcess

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
LIVE_BUDGET, SHADOW_BUDGET = 16, 12
DEPTH = 15  # the lab drafter's block of 16 holds 15 drafts after the root


def accept_length(new_tokens: int, budget: int) -> float:
    """What the agreeing pair must report: the prefill emits the first token, then each verify step
    accepts the tree's whole chain (min(budget, depth) drafts) plus the bonus token."""
    steps = math.ceil((new_tokens - 1) / (min(budget, DEPTH) + 1))
    return new_tokens / steps


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[dict[str, str]]:
    from ddtree_runtime.tiny_engine.tokenizer import TinyTokenizer

    words = TinyTokenizer().token_id(" cat"), TinyTokenizer().token_id(" dog")
    root = tmp_path_factory.mktemp("pairs")
    target, draft = write_agreeing_pair(lab_models(), root / "cat", words[0])
    changed, changed_draft = write_agreeing_pair(lab_models(), root / "dog", words[1])
    spec = {
        "live": [str(target), "DDTREE", "--speculative-draft-model-path", str(draft),
                 "--speculative-ddtree-budget", str(LIVE_BUDGET)],
        "shadow": [str(target), "DDTREE", "--speculative-draft-model-path", str(draft),
                   "--speculative-ddtree-budget", str(SHADOW_BUDGET)],
        "changed": [str(changed), "DDTREE", "--speculative-draft-model-path", str(changed_draft),
                    "--speculative-ddtree-budget", str(LIVE_BUDGET)],
        "plain": [str(target), "NONE", "--context-length", "48"],
    }
    logs = tmp_path_factory.mktemp("logs")
    procs = {}
    for name, (model, algo, *flags) in spec.items():
        argv = ["--model-path", model, "--speculative-algorithm", algo, "--device", "cpu", *flags]
        procs[name] = TinyServerProcess(argv, tmp=logs)
    try:
        for proc in procs.values():
            proc.wait_ready(timeout=300)
        yield {name: proc.url for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.stop()


def _compare(urls: dict[str, str], shadow: str, **kw) -> canary.CanaryReport:
    kw.setdefault("prompts", PROMPTS)
    kw.setdefault("rounds", 2)
    kw.setdefault("max_new_tokens", 16)
    # Both servers share two CPU cores with everything else: latency is checked on its own below.
    kw.setdefault("thresholds", Thresholds(max_latency_ratio=100.0))
    return canary.compare(urls["live"], urls[shadow], **kw)


def _check(report: canary.CanaryReport, name: str) -> canary.Check:
    (found,) = [c for c in report.checks if c.name == name]
    return found


# ---------------------------------------------------------------------------- real servers


def test_same_model_with_a_smaller_budget_promotes_with_both_sides_figures(servers):
    # 71 tokens: 5 verify steps of 16 on live, 6 of 13 on the shadow (ratio 5/6, above the default 0.8).
    new = 71
    report = _compare(servers, "shadow", max_new_tokens=new, live_release="rel-a", shadow_release="rel-b")
    assert report.ok and report.verdict == "promote" and report.exit_code == 0, report.reason
    assert [c.name for c in report.checks] == ["tokens", "accept_length", "latency"]
    assert report.tokens["equal"] and report.tokens["equal_prompts"] == len(PROMPTS)
    for side, budget, release in (("live", LIVE_BUDGET, "rel-a"), ("shadow", SHADOW_BUDGET, "rel-b")):
        figures = getattr(report, side)
        assert figures["requests"] == 2 * len(PROMPTS)
        assert figures["budget"] == budget and figures["release"] == release
        assert figures["accept_length"] == pytest.approx(accept_length(new, budget), abs=1e-3)
        assert figures["latency_median_s"] > 0
        assert figures["completion_tokens"] == 2 * len(PROMPTS) * new
    # The smaller budget accepts fewer tokens per step (certain: its tree holds fewer drafts), but not
    # below the default ratio.
    assert 0.8 <= report.ratios["accept"] < 1.0
    assert report.ratios["accept"] == pytest.approx(
        accept_length(new, SHADOW_BUDGET) / accept_length(new, LIVE_BUDGET), abs=1e-3)
    table = "\n".join(report.table())
    assert "canary PROMOTE" in table and str(report.live["accept_length"]) in table
    assert str(report.shadow["latency_median_s"]) in table


def test_other_tokens_abort_naming_the_prompt_and_position(servers):
    report = _compare(servers, "changed")
    tokens = _check(report, "tokens")
    assert not report.ok and report.verdict == "abort" and report.exit_code == 1
    assert not tokens.ok and not report.tokens["equal"]
    bad = [p for p in report.tokens["per_prompt"] if not p["equal"]]
    assert bad and bad[0]["differs"] == "shadow"
    first = bad[0]["first_difference"]
    assert bad[0]["live_ids"][:first] == bad[0]["other_ids"][:first]
    assert bad[0]["live_ids"][first] != bad[0]["other_ids"][first]
    assert repr(bad[0]["prompt"]) in tokens.detail and "tokens:" in report.reason


def test_token_differences_pass_when_allowed(servers):
    report = _compare(servers, "changed",
                      thresholds=Thresholds(require_equal_tokens=False, min_accept_ratio=0.01,
                                            max_latency_ratio=100.0))
    assert report.ok, report.reason
    assert not report.tokens["equal"]  # still reported


def test_acceptance_below_the_ratio_aborts(servers):
    report = _compare(servers, "shadow", thresholds=Thresholds(min_accept_ratio=1.0, max_latency_ratio=100.0))
    check = _check(report, "accept_length")
    assert not report.ok and not check.ok
    # 16 tokens: one verify step on live, two on the shadow.
    assert report.ratios["accept"] == pytest.approx(
        accept_length(16, SHADOW_BUDGET) / accept_length(16, LIVE_BUDGET), abs=1e-3) == 0.5
    assert f"{report.shadow['accept_length']:.3f}" in check.detail and "minimum 1" in check.detail


def test_shadow_without_speculative_decoding_aborts(servers):
    report = _compare(servers, "plain", max_new_tokens=8)
    check = _check(report, "accept_length")
    assert not check.ok and "does not run speculative decoding" in check.detail
    assert report.shadow["algorithm"] == "NONE" and report.shadow["accept_length"] is None
    assert report.tokens["equal"]  # lossless: the same target gives the same greedy tokens


def test_latency_above_the_ratio_aborts(servers):
    report = _compare(servers, "shadow", thresholds=Thresholds(max_latency_ratio=0.01, latency_slack_s=0.0))
    check = _check(report, "latency")
    assert not report.ok and not check.ok
    assert f"{report.shadow['latency_median_s']}" in check.detail


def test_a_failing_request_aborts_with_the_servers_message(servers):
    report = _compare(servers, "plain", max_new_tokens=64)  # beyond the plain server's 48-token context
    assert not report.ok and report.checks[0].name == "generate"
    assert "HTTP 400" in report.reason and "maximum context length" in report.reason


def test_cli_json_report_file_and_exit_codes(servers, tmp_path):
    out = tmp_path / "canary" / "last.json"
    base = [sys.executable, "-m", "ddtree_runtime", "canary", "compare", "--live", servers["live"],
            "--rounds", "1", "--max-new-tokens", "8", "--max-latency-ratio", "100", "--prompts", *PROMPTS]
    ok = subprocess.run([*base, "--shadow", servers["shadow"], "--json", "--write-report", str(out)],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    doc = json.loads(ok.stdout)
    assert doc == json.loads(out.read_text())
    assert doc["verdict"] == "promote" and doc["live"]["accept_length"] and doc["shadow"]["accept_length"]
    assert doc["table"][0].startswith("canary PROMOTE")

    bad = subprocess.run([*base, "--shadow", servers["changed"]], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and bad.stdout.startswith("canary ABORT: tokens:")
    assert "live" in bad.stdout and "shadow" in bad.stdout and "accept length" in bad.stdout

    gone = subprocess.run([*base, "--shadow", f"http://127.0.0.1:{free_port()}", "--ready-timeout", "1",
                           "--json"], capture_output=True, text=True, timeout=60)
    assert gone.returncode == 3 and json.loads(gone.stdout)["reason"].startswith("not ready: shadow")

    same = subprocess.run([*base, "--shadow", servers["live"] + "/"],
                          capture_output=True, text=True, timeout=60)
    assert same.returncode == 2 and "same server" in same.stdout


# ---------------------------------------------------------------------------- thresholds, no servers


def _side(name: str, latencies: list[float], tokens: int = 10, verify: int | None = 4) -> Side:
    side = Side(name, f"http://{name}")
    side.answers = [Answer("p", [1, 2], "x", tokens, verify, lat) for lat in latencies]
    return side


@pytest.mark.parametrize(("shadow_lat", "ok"), [(0.80, True), (0.81, False)])
def test_latency_limit_is_ratio_times_live_plus_slack(shadow_lat, ok):
    live, shadow = _side("live", [0.4, 0.5, 0.6]), _side("shadow", [shadow_lat] * 3)
    tokens = canary.compare_tokens(live, shadow, 1)
    th = Thresholds(max_latency_ratio=1.5, latency_slack_s=0.05)
    checks, ratios = canary.judge(live, shadow, tokens, th)
    assert {c.name: c.ok for c in checks}["latency"] is ok  # limit 0.5 * 1.5 + 0.05 = 0.80
    assert ratios["latency"] == pytest.approx(shadow_lat / 0.5, abs=1e-3)


@pytest.mark.parametrize(("shadow_verify", "ok"), [(5, True), (6, False)])
def test_accept_ratio_uses_tokens_per_verify_step(shadow_verify, ok):
    live = _side("live", [0.1], tokens=12, verify=4)  # 3.0
    shadow = _side("shadow", [0.1], tokens=12, verify=shadow_verify)  # 2.4 / 2.0
    checks, ratios = canary.judge(live, shadow, canary.compare_tokens(live, shadow, 1),
                                  Thresholds(min_accept_ratio=0.8))
    assert {c.name: c.ok for c in checks}["accept_length"] is ok
    assert ratios["accept"] == pytest.approx(12 / shadow_verify / 3.0, abs=1e-3)


def test_live_that_changes_its_own_answer_fails_the_token_check():
    live, shadow = _side("live", [0.1, 0.1]), _side("shadow", [0.1, 0.1])
    live.answers[1].output_ids = [1, 3]
    tokens = canary.compare_tokens(live, shadow, 1)
    assert not tokens["equal"] and tokens["per_prompt"][0]["differs"].startswith("live")
    assert tokens["per_prompt"][0]["first_difference"] == 1


@pytest.mark.parametrize("kw", [{"min_accept_ratio": 0}, {"max_latency_ratio": -1},
                                {"latency_slack_s": -0.1}])
def test_bad_thresholds_are_refused_with_the_flag_named(kw):
    with pytest.raises(CanaryInputError, match="--"):
        canary.compare("http://127.0.0.1:1", "http://127.0.0.1:2", thresholds=Thresholds(**kw))


def test_bad_urls_and_unreachable_sides():
    with pytest.raises(CanaryInputError, match="not an http"):
        canary.compare("127.0.0.1:30000", "http://127.0.0.1:2")
    with pytest.raises(SideUnavailable, match=r"^live http://127\.0\.0\.1"):
        canary.compare(f"http://127.0.0.1:{free_port()}", "http://127.0.0.1:2", ready_timeout=0.5)
