"""Metrics from the host's state files: textfile for node_exporter, the exporter scraped over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ddtree_runtime.health import metrics
from ddtree_runtime.health.probe_live import live_probe
from ddtree_runtime.health.probe_report import write_report
from tests.unit._tiny_engine import free_port
from tests.unit.fake_sglang import FakeSGLang, Scenario


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A host's /var/lib/ddtree after a deploy: state file, a real live probe report, two rollouts."""
    root = tmp_path / "ddtree"
    (root / "state").mkdir(parents=True)
    (root / "state" / "sglang-qwen.json").write_text(json.dumps(
        {"profile": "balanced", "release": "r-3f2a9c", "deployed_at": "2026-11-29T10:00:00+00:00",
         "previous_release": "r-11aa00"}))
    with FakeSGLang(Scenario(completion_tokens=30, spec_verify_ct=10)) as srv:
        report = live_probe(srv.url, timeout=5, poll_s=0.05, min_accept_length=2, max_new_tokens=30,
                            allow_lossless_unchecked=True)
    report.figures["probe_seconds"] = 1.25
    write_report(report, str(root / "probe" / "sglang-qwen.json"))
    metrics.record_rollout(str(root), "sglang-qwen.service", "rolled_back", release="r-4",
                           cause="port_in_use")
    metrics.record_rollout(str(root), "sglang-qwen", "success", release="r-3f2a9c", profile="balanced")
    return root


def test_state_files_become_metrics(host: Path):
    text = metrics.generate_latest(metrics.build_registry(str(host), systemd=False)).decode()
    s = _samples(text)
    u = ("unit", "sglang-qwen")
    assert s[("ddtree_probe_success", (("probe", "live"), u))] == 1.0
    assert s[("ddtree_probe_duration_seconds", (("probe", "live"), u))] == 1.25
    assert abs(s[("ddtree_probe_timestamp_seconds", (("probe", "live"), u))] - time.time()) < 60
    assert s[("ddtree_spec_accept_length", (u,))] == 3.0
    assert s[("ddtree_handshake_expected_hidden_width", (u,))] == 25600
    assert s[("ddtree_handshake_observed_hidden_width", (u,))] == 25600
    assert s[("ddtree_handshake_ok", (u,))] == 1.0
    assert s[("ddtree_budget", (u,))] == 16
    # the recorded server has no /tokenize: not checked, and no counts that would read as a clean check
    assert s[("ddtree_probe_lossless_checked", (u,))] == 0.0
    assert ("ddtree_probe_lossless_mismatches", (u,)) not in s
    assert s[("ddtree_deploy_info", (("profile", "balanced"), ("release", "r-3f2a9c"), u))] == 1.0
    assert s[("ddtree_deploy_timestamp_seconds", (u,))] == 1795946400.0
    assert s[("ddtree_rollouts_total", (("outcome", "rolled_back"), u))] == 1.0
    assert s[("ddtree_rollouts_total", (("outcome", "success"), u))] == 1.0
    assert s[("ddtree_rollouts_total", (("outcome", "failed"), u))] == 0.0
    assert s[("ddtree_rollout_last_success", (("outcome", "success"), u))] == 1.0
    # the shadow unit has no files yet: no series for it (absent, not zero)
    assert not [k for k in s if ("unit", "sglang-qwen-shadow") in k[1]]
    # our names: ddtree_ prefix, underscores only (colons are for recording rules)
    assert all(name.startswith("ddtree_") and ":" not in name for name, _ in s)


def test_a_probe_that_found_the_verify_not_lossless_exposes_the_counts(host: Path):
    from ddtree_runtime.health import lossless
    from ddtree_runtime.health.probe_lossless import check_lossless_result
    from ddtree_runtime.health.probe_report import Report
    from tests.unit._lossless_answers import PROMPT, answer

    gen = lossless.Generation(PROMPT, [5, 2, 9])
    tops = [[(-0.4, 5), (-1.2, 3)], [(-0.3, 6), (-2.1, 2)], [(-0.8, 4), (-0.9, 9)]]
    report = Report("live")
    check_lossless_result(report, lossless.compare_answers([gen], [answer(gen, tops)]))
    write_report(report, str(host / "probe" / "sglang-qwen-shadow.json"))
    s = _samples(metrics.generate_latest(metrics.build_registry(str(host), systemd=False)).decode())
    u = ("unit", "sglang-qwen-shadow")
    assert s[("ddtree_probe_failure_info", (("cause", "verify_not_lossless"), ("probe", "live"), u))] == 1.0
    assert s[("ddtree_probe_lossless_checked", (u,))] == 1.0
    assert s[("ddtree_probe_lossless_tokens_checked", (u,))] == 3.0
    assert s[("ddtree_probe_lossless_mismatches", (u,))] == 1.0
    assert s[("ddtree_probe_lossless_near_ties", (u,))] == 1.0


def test_a_check_that_could_not_run_is_not_counted_as_checked(host: Path):
    from ddtree_runtime.health import lossless
    from ddtree_runtime.health.probe_lossless import check_lossless_result
    from ddtree_runtime.health.probe_report import Report
    from tests.unit._lossless_answers import PROMPT, answer

    gens = [lossless.Generation(PROMPT, [5]), lossless.Generation([3], [4])]
    good = answer(gens[0], [[(-0.1, 5), (-2.0, 1)]])
    report = Report("live")
    check_lossless_result(report, lossless.compare_answers(gens, [good, {"text": "x"}]))
    write_report(report, str(host / "probe" / "sglang-qwen.json"))
    s = _samples(metrics.generate_latest(metrics.build_registry(str(host), systemd=False)).decode())
    u = ("unit", "sglang-qwen")
    assert s[("ddtree_probe_failure_info", (("cause", "lossless_check_error"), ("probe", "live"), u))] == 1.0
    assert s[("ddtree_probe_lossless_checked", (u,))] == 0.0
    assert s[("ddtree_probe_lossless_errors", (u,))] == 1.0
    assert s[("ddtree_probe_lossless_mismatches", (u,))] == 0


def test_failed_probe_exposes_its_cause(host: Path):
    sc = Scenario()
    sc.server_info["ddtree_handshake"].update(status="mismatch", observed_hidden_width=5120)
    with FakeSGLang(sc) as srv:
        report = live_probe(srv.url, timeout=5, poll_s=0.05)
    write_report(report, str(host / "probe" / "sglang-qwen-shadow.json"))
    s = _samples(metrics.generate_latest(metrics.build_registry(str(host), systemd=False)).decode())
    u = ("unit", "sglang-qwen-shadow")
    assert s[("ddtree_probe_success", (("probe", "live"), u))] == 0.0
    assert s[("ddtree_probe_failure_info", (("cause", "hidden_width_mismatch"), ("probe", "live"), u))] == 1
    assert s[("ddtree_handshake_ok", (u,))] == 0.0
    assert s[("ddtree_handshake_observed_hidden_width", (u,))] == 5120


def test_rollout_counter_persists_and_rejects_unknown_outcome(tmp_path: Path):
    for _ in range(3):
        doc = metrics.record_rollout(str(tmp_path), "sglang-qwen", "failed", cause="crash_loop")
    assert doc["counts"] == {"failed": 3} and doc["last"]["cause"] == "crash_loop"
    with pytest.raises(ValueError, match="use one of success, failed, rolled_back"):
        metrics.record_rollout(str(tmp_path), "sglang-qwen", "maybe")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddtree_runtime", "metrics", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_textfile_is_written_atomically_and_parses(host: Path, tmp_path: Path):
    textdir = tmp_path / "textfile"
    res = _cli("record-rollout", "--state-dir", str(host), "--unit", "sglang-qwen", "--outcome", "failed",
               "--cause", "crash_loop", "--textfile-dir", str(textdir), "--no-systemd")
    assert res.returncode == 0, res.stderr
    prom = textdir / "ddtree.prom"
    assert sorted(p.name for p in textdir.iterdir()) == ["ddtree.prom"]  # no temp file left behind
    assert oct(prom.stat().st_mode & 0o777) == "0o644"
    s = _samples(prom.read_text())
    assert s[("ddtree_rollouts_total", (("outcome", "failed"), ("unit", "sglang-qwen")))] == 1.0
    assert s[("ddtree_rollout_last_success", (("outcome", "failed"), ("unit", "sglang-qwen")))] == 0.0

    res = _cli("record-probe", "--state-dir", str(host), "--unit", "x", "--report", str(prom))
    assert res.returncode == 2 and "not a probe report" in res.stderr
    res = _cli("textfile", "--state-dir", str(host))
    assert res.returncode == 2 and "--textfile-dir" in res.stderr
    res = _cli("textfile", "--state-dir", str(host), "--textfile-dir", str(textdir), "--no-systemd")
    assert res.returncode == 0
    assert _samples(prom.read_text())[("ddtree_budget", (("unit", "sglang-qwen"),))] == 16
    res = _cli("serve", "--listen", "nope")
    assert res.returncode == 2 and "ADDRESS:PORT" in res.stderr


def test_exporter_is_scraped_over_http(host: Path):
    port = free_port()  # held until this process ends: no other test's server can take it meanwhile
    proc = subprocess.Popen([sys.executable, "-m", "ddtree_runtime", "metrics", "serve", "--listen",
                             f"127.0.0.1:{port}", "--state-dir", str(host), "--no-systemd"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        body = None
        for _ in range(100):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
                    body = resp.read().decode()
                break
            except OSError:
                time.sleep(0.1)
        assert body is not None, "exporter never answered"
        first = _samples(body)
        assert first[("ddtree_spec_accept_length", (("unit", "sglang-qwen"),))] == 3.0
        assert "python_gc_objects_collected_total" not in body  # own registry only
        # the exporter reads the files at each scrape: a new rollout shows without a restart
        metrics.record_rollout(str(host), "sglang-qwen", "success")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            second = _samples(resp.read().decode())
        key = ("ddtree_rollouts_total", (("outcome", "success"), ("unit", "sglang-qwen")))
        assert second[key] == first[key] + 1
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_systemd_facts_parse_systemctl_show(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # systemctl's `show -p` output format; the lab tests read the real thing from a lab host.
    fake = tmp_path / "systemctl"
    up_us = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6) - 120_000_000
    fake.write_text("#!/bin/sh\n"
                    "printf 'ActiveState=active\\nSubState=running\\nNRestarts=4\\n"
                    f"ActiveEnterTimestampMonotonic={up_us}\\nLoadState=loaded\\n'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    facts = metrics.systemd_unit_facts("sglang-qwen")
    assert facts["active"] == "active" and facts["restarts"] == 4
    assert 119 < facts["uptime_seconds"] < 130
    s = _samples(metrics.generate_latest(metrics.build_registry(str(tmp_path / "none"))).decode())
    assert s[("ddtree_unit_restarts_total", (("unit", "sglang-qwen"),))] == 4
    assert s[("ddtree_unit_active", (("unit", "sglang-qwen-shadow"),))] == 1
