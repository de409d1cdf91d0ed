"""Live probe against a stdlib HTTP server answering with recorded SGLang 0.5.23 bodies."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from ddtree_runtime.health.probe import attach_diagnosis
from ddtree_runtime.health.probe_live import live_probe
from ddtree_runtime.health.probe_report import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_NOT_READY, EXIT_PASS
from tests.unit.fake_sglang import FakeSGLang, Scenario, Toy

REPORT_KEYS = {"probe", "ok", "cause", "message", "checks", "figures", "handshake", "time"}


def _probe(scenario: Scenario, **kw):
    with FakeSGLang(scenario) as srv:
        kw.setdefault("timeout", 5)
        # Without a toy the fake has no /tokenize nor logprob fields: the tests of other checks allow that.
        kw.setdefault("allow_lossless_unchecked", scenario.toy is None)
        return live_probe(srv.url, poll_s=0.05, **kw), srv


def test_healthy_server_passes_with_figures_and_greedy_requests():
    sc = Scenario(not_ready_polls=3, completion_tokens=32, spec_verify_ct=8)
    report, _ = _probe(sc, min_accept_length=2.0, prompts=["a", "b"], max_new_tokens=32)
    assert report.ok and report.exit_code == EXIT_PASS, report.message
    assert [c.name for c in report.checks] == ["ready", "generate", "flags", "handshake", "lossless",
                                               "accept_length"]
    # A server without SGLang's /tokenize and logprob fields: said so, passed only where allowed.
    assert report.figures["lossless"]["status"] == "not_checked"
    assert "POST /tokenize answered HTTP 404" in report.checks[4].detail and report.checks[4].ok
    assert "lossless not checked" in report.message
    assert report.figures["accept_length"] == 4.0
    assert report.figures["accept_length_source"].startswith("generate meta_info")
    assert report.figures["completion_tokens"] == 64
    assert report.figures["observed_hidden_width"] == 25600
    assert report.handshake["status"] == "ok"
    posts = [json.loads(s.split(" ", 2)[2]) for s in sc.seen if s.startswith("POST /generate")]
    assert [p["text"] for p in posts][:2] == ["a", "b"] and sorted(p["text"] for p in posts[2:]) == ["a", "b"]
    assert all(p["sampling_params"] == {"temperature": 0, "max_new_tokens": 32} for p in posts)
    assert sc.seen.count("GET /health_generate") == 4  # three 503s, then 200
    assert set(report.to_dict()) >= REPORT_KEYS


def test_not_ready_in_time_is_exit_3():
    report, _ = _probe(Scenario(not_ready_polls=10**6), timeout=0.5)
    assert (report.ok, report.exit_code, report.cause) == (False, EXIT_NOT_READY, "not_ready")
    assert "HTTP 503" in report.checks[-1].detail


def test_unreachable_is_exit_3():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report = live_probe(f"http://127.0.0.1:{port}", timeout=0.3, poll_s=0.05)
    assert (report.exit_code, report.cause) == (EXIT_NOT_READY, "unreachable")


@pytest.mark.parametrize(("status", "observed", "cause"), [
    ("mismatch", 5120, "hidden_width_mismatch"),
    ("ok", 5120, "hidden_width_mismatch"),       # status says ok but the numbers disagree
    ("missing", None, "hidden_states_missing"),
    ("pending", None, "handshake_pending"),
])
def test_handshake_failures_are_named(status, observed, cause):
    sc = Scenario()
    sc.server_info["ddtree_handshake"].update(status=status, observed_hidden_width=observed)
    report, _ = _probe(sc)
    assert (report.exit_code, report.cause) == (EXIT_FAILED, cause)
    assert [c.name for c in report.checks if not c.ok] == ["handshake"]


def test_ddtree_without_handshake_means_plugin_missing():
    sc = Scenario()
    del sc.server_info["ddtree_handshake"]
    report, _ = _probe(sc)
    assert report.cause == "plugin_not_registered"


def test_wrong_algorithm_or_profile_flag_fails_flags_check():
    sc = Scenario()
    sc.server_info["speculative_algorithm"] = "DFLASH"
    report, _ = _probe(sc)
    assert report.cause == "flags_mismatch" and "DFLASH" in report.message
    report, _ = _probe(Scenario(), expect={"context_length": "8192"})
    assert report.cause == "flags_mismatch" and "context_length=32768" in report.message
    report, _ = _probe(Scenario(), expect={"context_length": "32768", "disable_cuda_graph": "false"})
    assert report.ok


def test_generation_error_body_is_diagnosed():
    error = "RuntimeError: DFLASH verify requires target hidden states, but got None."
    sc = Scenario(generate_error=(500, error))
    report, _ = _probe(sc)
    assert (report.exit_code, report.cause) == (EXIT_FAILED, "hidden_states_missing")
    sc = Scenario(generate_error=(500, "Internal Server Error"))
    report, _ = _probe(sc)
    assert report.cause == "generation_failed" and "HTTP 500" in report.message


def test_empty_answer_fails():
    report, _ = _probe(Scenario(text="  "))
    assert report.cause == "empty_answer"


def test_acceptance_threshold_and_fallback_sources():
    report, _ = _probe(Scenario(completion_tokens=10, spec_verify_ct=10), min_accept_length=1.5,
                       max_new_tokens=10)
    assert report.cause == "acceptance_low" and report.figures["accept_length"] == 1.0

    sc = Scenario(spec_verify_ct=None)  # no per-request spec meta: server state is next
    report, _ = _probe(sc, min_accept_length=3.0)
    assert report.ok and report.figures["accept_length"] == 3.5
    assert report.figures["accept_length_source"] == "server_info internal_states"

    sc = Scenario(spec_verify_ct=None, metrics='sglang:spec_accept_length{model_name="q"} 2.25\n')
    sc.server_info["internal_states"] = [{}]
    report, _ = _probe(sc, min_accept_length=3.0)
    assert report.cause == "acceptance_low" and report.figures["accept_length"] == 2.25

    sc = Scenario(spec_verify_ct=None)
    sc.server_info["internal_states"] = []
    report, _ = _probe(sc, min_accept_length=1.0)
    assert report.cause == "acceptance_low" and "not reported" in report.message
    report, _ = _probe(Scenario(spec_verify_ct=None, server_info={**sc.server_info}))
    assert report.ok and report.figures["accept_length"] is None  # no threshold: reported only


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ddtree_runtime", "probe", "live", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_json_report_file_and_exit_codes(tmp_path):
    out = tmp_path / "probe" / "sglang-qwen.json"
    with FakeSGLang() as srv:
        res = _cli("--url", srv.url, "--json", "--min-accept-length", "3", "--write-report", str(out),
                   "--allow-lossless-unchecked")
        assert res.returncode == EXIT_PASS, res.stdout + res.stderr
        printed = json.loads(res.stdout)
        assert printed == json.loads(out.read_text())
        assert printed["probe"] == "live" and printed["ok"] is True
        assert printed["figures"]["accept_length"] == 4.0

        res = _cli("--url", srv.url, "--min-accept-length", "9", "--allow-lossless-unchecked")
        assert res.returncode == EXIT_FAILED
        assert "FAIL [acceptance_low]" in res.stdout and "minimum 9" in res.stdout
        # Without the operator's allowance a server the check cannot read fails.
        res = _cli("--url", srv.url)
        assert res.returncode == EXIT_FAILED and "FAIL [lossless_not_checked]" in res.stdout

    res = _cli("--url", "localhost:30000")
    assert res.returncode == EXIT_BAD_INPUT and "not an http(s) URL" in res.stdout
    res = _cli("--url", "http://127.0.0.1:9", "--expect", "oops")
    assert res.returncode == EXIT_BAD_INPUT and "KEY=VALUE" in res.stdout


def test_unit_journal_names_a_vague_failure(tmp_path, monkeypatch):
    # journalctl's output for a unit that died at start-up; the lab host tests read the real journal.
    fake = tmp_path / "journalctl"
    fake.write_text("#!/bin/sh\necho 'sglang[9]: RuntimeError: Not enough memory. Please try to increase "
                    "--mem-fraction-static. Current value: mem_fraction_static=0.2'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    report, _ = _probe(Scenario(not_ready_polls=10**6), timeout=0.3)
    assert report.cause == "not_ready"
    attach_diagnosis(report, "sglang-qwen", settle_s=0)
    assert report.cause == "mem_fraction_too_small" and report.exit_code == EXIT_NOT_READY
    assert "mem_fraction_static=0.2" in report.message and "Fix: raise mem-fraction-static" in report.message
    assert report.figures["diagnosis"][0]["cause"] == "mem_fraction_too_small"

    fake.write_text("#!/bin/sh\necho 'all quiet'\n")
    report, _ = _probe(Scenario(not_ready_polls=10**6), timeout=0.3)
    attach_diagnosis(report, "sglang-qwen", settle_s=0)
    assert report.cause == "not_ready" and report.figures["diagnosis"] == []


# ---------------------------------------------------------------------------- fail closed (issue 31)
# A toy server with /tokenize and SGLang's logprob fields: its prefill is the target's, its decode is
# wrong in the ways a broken verify is.


def _toy(**kw) -> tuple:
    report, _ = _probe(Scenario(toy=Toy(**kw)), prompts=["the cat", "a dog runs"], max_new_tokens=32)
    return report, report.figures.get("lossless") or {}


def test_a_correct_server_passes_every_prompt_checked_alone_and_in_a_batch():
    report, doc = _toy(near_tie_every=3)
    assert report.ok, report.message
    assert doc["status"] == "passed" and doc["prompts"] == 4 and doc["tokens_checked"] == 128
    assert (doc["mismatches"], doc["near_ties"], doc["errors"]) == (0, 0, [])
    assert len(report.figures["batch_answers"]) == 2


def test_a_server_without_the_fields_fails_unless_the_operator_allowed_it():
    report, _ = _probe(Scenario(), allow_lossless_unchecked=False)
    assert (report.ok, report.cause) == (False, "lossless_not_checked")
    assert "ddtree_probe_allow_lossless_unchecked" in report.message


@pytest.mark.parametrize(("kw", "fragment"), [
    ({"tokenize_status": 500}, "POST /tokenize answered HTTP 500"),
    ({"check_status": {0: 500, 1: 500}}, "answered HTTP 500"),
    ({"out_of_vocab_prompt": 1}, "outside the vocabulary"),
])
def test_a_check_that_cannot_run_on_a_server_with_the_fields_fails_with_its_own_cause(kw, fragment):
    report, _ = _toy(**kw)
    assert (report.ok, report.exit_code, report.cause) == (False, EXIT_FAILED, "lossless_check_error")
    assert fragment in report.message


def test_one_prompts_failed_check_never_hides_anothers_mismatch():
    report, doc = _toy(check_status={0: 500}, wrong_at=3)
    assert report.cause == "verify_not_lossless" and doc["mismatches"] == 2  # prompt 1, alone and batched
    assert len(doc["errors"]) == 2 and all("prompt 0" in e or "prompt 2" in e for e in doc["errors"])


@pytest.mark.parametrize(("kw", "ok"), [({"emit": 30}, False), ({"emit": 34}, False), ({"stop_at": 5}, True)])
def test_emitted_token_counts_are_what_was_asked_stop_respected(kw, ok):
    report, _ = _toy(**kw)
    assert report.ok is ok, report.message
    if not ok:
        assert report.cause == "wrong_token_count" and "for max_new_tokens 32" in report.message


@pytest.mark.parametrize("kw", [{"wrong_at": 4, "wrong_in_batch_only": True},
                                {"near_tie_every": 2, "flip_near_ties": True},
                                {"zero_probability_at": 2}])
def test_wrong_only_in_a_batch_flipped_near_ties_and_zero_probability_are_not_lossless(kw):
    report, doc = _toy(**kw)
    assert (report.ok, report.cause) == (False, "verify_not_lossless"), report.message
    assert doc["status"] == "failed"


def test_the_roles_allowance_is_a_strict_boolean_and_reaches_the_probe_command():
    from pathlib import Path

    from ddtree_runtime.inputs.role_checks import probe_problems

    good = {"url": "http://127.0.0.1:30000", "unit_name": "sglang-qwen", "model_path": "/m/t",
            "draft_model_path": "/m/d", "report_dir": "/var/lib/ddtree/probe", "min_accept_length": 1.5,
            "timeout": 300, "journal_since": "", "expect": {}}
    assert probe_problems({**good, "allow_lossless_unchecked": "false"}) == []
    problems = probe_problems({**good, "allow_lossless_unchecked": "flase"})
    assert len(problems) == 1 and "ddtree_probe_allow_lossless_unchecked" in problems[0]
    role = Path(__file__).resolve().parents[2] / "roles" / "ddtree_probe"
    assert "ddtree_probe_allow_lossless_unchecked: false" in (role / "defaults" / "main.yml").read_text()
    assert "'--allow-lossless-unchecked'" in (role / "tasks" / "live.yml").read_text()
