"""Live and static probes against the real lab engine (`ddtree tiny-engine serve`, SGLang's HTTP surface).

The lab faults reproduce the field failures; each must end in the probe's documented exit code
and a named cause (from the report, or from the server's log through diagnose.scan).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddtree_runtime.health import diagnose
from ddtree_runtime.health.probe_live import live_probe
from ddtree_runtime.health.probe_report import EXIT_FAILED, EXIT_NOT_READY, EXIT_PASS
from ddtree_runtime.health.probe_static import static_probe
from tests.unit._tiny_engine import contrary_drafter
from tests.unit._tiny_server import TinyServerProcess


def _serve_args(models: Path, *extra: str, draft: str = "draft") -> list[str]:
    return ["--model-path", str(models / "target"), "--speculative-algorithm", "DDTREE",
            "--speculative-draft-model-path", str(models / draft), "--speculative-ddtree-budget", "16",
            "--device", "cpu", "--enable-metrics", *extra]


@pytest.fixture(scope="module")
def ddtree_server(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyServerProcess]:
    srv = TinyServerProcess(_serve_args(models), tmp=tmp_path_factory.mktemp("serve"))
    try:
        yield srv
    finally:
        srv.stop()


def _probe_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddtree_runtime", "probe", *args],
                          capture_output=True, text=True, timeout=300)


def test_healthy_ddtree_server_passes(ddtree_server: TinyServerProcess, tmp_path: Path):
    out = tmp_path / "probe" / "sglang-qwen.json"
    res = _probe_cli("live", "--url", ddtree_server.url, "--timeout", "120", "--min-accept-length", "1.5",
                     "--expect", "speculative_ddtree_budget=16", "--json", "--write-report", str(out))
    assert res.returncode == EXIT_PASS, res.stdout + res.stderr
    report = json.loads(out.read_text())
    assert report["ok"] and [c["name"] for c in report["checks"]] == [
        "ready", "generate", "flags", "handshake", "lossless", "accept_length"]
    hs = report["handshake"]
    assert hs["status"] == "ok" and hs["expected_hidden_width"] == hs["observed_hidden_width"]
    assert report["figures"]["accept_length"] > 1.5
    assert all(a["text"].strip() for a in report["figures"]["answers"])
    checked = report["figures"]["lossless"]
    assert (checked["status"], checked["mismatches"], checked["near_ties"]) == ("passed", 0, 0)
    # 3 prompts x 32, one at a time and again all at once, each answer checked by a request of its own
    assert checked["tokens_checked"] == 2 * report["figures"]["completion_tokens"] == 192
    assert checked["prompts"] == 6 and len(report["figures"]["batch_answers"]) == 3


def test_a_verify_that_is_not_lossless_fails_though_fluent_and_accepting(models: Path, tmp_path: Path):
    """relaxed_accept: the walk also takes drafted tokens the target ranks second or third. The answers
    read as well and the acceptance length clears the deploy's minimum; only the lossless check sees it."""
    srv = TinyServerProcess(_serve_args(models), env={"DDTREE_LAB_FAULT": "relaxed_accept"}, tmp=tmp_path)
    try:
        report = live_probe(srv.url, timeout=120, poll_s=0.2, min_accept_length=1.5)
        res = _probe_cli("live", "--url", srv.url, "--timeout", "60")
    finally:
        srv.stop()
    assert (report.exit_code, report.cause) == (EXIT_FAILED, "verify_not_lossless"), report.message
    assert [c.name for c in report.checks if not c.ok] == ["lossless"]
    assert report.figures["accept_length"] >= 1.5
    assert all(a["text"].strip() for a in report.figures["answers"])
    checked = report.figures["lossless"]
    first = checked["first_mismatch"]
    assert checked["mismatches"] >= 3 and first["gap_nats"] > checked["margin_nats"]
    assert first["emitted_token"] != first["target_token"]
    assert first["emitted_logprob"] < first["target_logprob"]
    assert "not lossless" in report.message and f"emitted {first['emitted_token']}" in report.message
    assert res.returncode == EXIT_FAILED and "FAIL [verify_not_lossless]" in res.stdout


def test_a_drafter_that_never_agrees_still_passes_the_lossless_check(models: Path, tmp_path: Path):
    """Acceptance 1: every token is the verify's bonus (the root row's choice); still the target's own."""
    draft = contrary_drafter(models, tmp_path / "contrary")
    srv = TinyServerProcess(_serve_args(models, draft=str(draft)), tmp=tmp_path)
    try:
        report = live_probe(srv.url, timeout=120, poll_s=0.2)
    finally:
        srv.stop()
    assert report.ok, report.message
    assert report.figures["accept_length"] < 1.1
    checked = report.figures["lossless"]
    assert (checked["status"], checked["tokens_checked"], checked["mismatches"]) == ("passed", 192, 0)


def test_greedy_answers_repeat_exactly(ddtree_server: TinyServerProcess):
    first = live_probe(ddtree_server.url, timeout=120, poll_s=0.2)
    second = live_probe(ddtree_server.url, timeout=120, poll_s=0.2)
    assert first.ok and second.ok
    ids = [[a["output_ids"] for a in r.figures["answers"]] for r in (first, second)]
    assert ids[0] == ids[1]  # T=0: the canary compares these token for token


def test_thresholds_and_expected_flags_fail_with_exit_1(ddtree_server: TinyServerProcess):
    res = _probe_cli("live", "--url", ddtree_server.url, "--min-accept-length", "40")
    assert res.returncode == EXIT_FAILED and "FAIL [acceptance_low]" in res.stdout
    report = live_probe(ddtree_server.url, timeout=60, expect={"speculative_ddtree_budget": "8"})
    assert report.cause == "flags_mismatch" and "speculative_ddtree_budget=16" in report.message


def test_server_without_speculation_fails_the_flags_check(models: Path, tmp_path: Path):
    srv = TinyServerProcess(["--model-path", str(models / "target"), "--device", "cpu"], tmp=tmp_path)
    try:
        report = live_probe(srv.url, timeout=120, poll_s=0.2)
    finally:
        srv.stop()
    assert (report.exit_code, report.cause) == (EXIT_FAILED, "flags_mismatch")
    assert "speculative_algorithm='NONE'" in report.message or "speculative_algorithm=None" in report.message


@pytest.mark.parametrize(("fault", "cause"), [
    ("capture_predicate", "hidden_width_mismatch"),
    ("hidden_none", "hidden_states_missing"),
])
def test_hidden_state_faults_are_named(models: Path, tmp_path: Path, fault: str, cause: str):
    srv = TinyServerProcess(_serve_args(models), env={"DDTREE_LAB_FAULT": fault}, tmp=tmp_path)
    rc = srv.wait_exit(120)  # warm-up runs a real generation: the fault strikes during start-up
    assert rc == -9  # SGLang's way: the server SIGKILLs itself
    report = live_probe(srv.url, timeout=1, poll_s=0.2)
    assert (report.exit_code, report.ok) == (EXIT_NOT_READY, False)
    findings = diagnose.scan(srv.log)
    assert findings and findings[0].cause == cause


def test_slow_start_is_not_ready_in_time(models: Path, tmp_path: Path):
    env = {"DDTREE_LAB_FAULT": "slow_start", "DDTREE_LAB_START_DELAY_S": "30"}
    srv = TinyServerProcess(_serve_args(models), env=env, tmp=tmp_path)
    try:
        report = live_probe(srv.url, timeout=2, poll_s=0.2)
    finally:
        srv.stop()
    assert report.exit_code == EXIT_NOT_READY and report.cause in ("not_ready", "unreachable")


def test_memory_fraction_too_small_never_listens(models: Path, tmp_path: Path):
    srv = TinyServerProcess(_serve_args(models, "--mem-fraction-static", "0.01", "--context-length", "4096"),
                           tmp=tmp_path)
    rc = srv.wait_exit(60)
    report = live_probe(srv.url, timeout=1, poll_s=0.2)
    assert rc != 0 and (report.exit_code, report.cause) == (EXIT_NOT_READY, "unreachable")
    assert [f.cause for f in diagnose.scan(srv.log)][:1] == ["mem_fraction_too_small"]


def test_static_probe_on_the_lab_models(models: Path):
    good = static_probe(str(models / "target"), str(models / "draft"))
    assert good.ok and good.handshake["expected_hidden_width"] == good.handshake["draft_fc_in_features"]
    bad = static_probe(str(models / "target"), str(models / "draft-mismatched"))
    assert (bad.exit_code, bad.cause) == (EXIT_FAILED, "hidden_width_mismatch")


def test_probe_stops_waiting_once_systemd_gave_up(models: Path, tmp_path: Path, monkeypatch):
    # systemctl's answer for a unit past its start limit; the lab host tests see the real one.
    fake = tmp_path / "systemctl"
    fake.write_text("#!/bin/sh\necho ActiveState=failed\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    report = live_probe("http://127.0.0.1:9", timeout=300, poll_s=0.1, unit="sglang-qwen")
    assert report.exit_code == EXIT_NOT_READY and "systemd gave up on sglang-qwen" in report.message
    assert report.checks[-1].detail.endswith("(failed)")
