"""Broken state files under /var/lib/ddtree against the metrics collector, `metrics textfile` and
`metrics serve`: one bad file costs only its own series (skipped and named in
ddtree_state_file_unreadable), every other series stays, nothing crashes, no scrape answers 500.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ddtree_runtime.health import metrics
from tests.unit._tiny_engine import free_port

GOOD_PROBE = {"probe": "live", "ok": True, "cause": None, "time": 1.7e9,
              "figures": {"probe_seconds": 2.0, "accept_length": 3.5},
              "handshake": {"status": "ok", "expected_hidden_width": 25600, "observed_hidden_width": 25600,
                            "budget": 16}}
GOOD_STATE = {"profile": "balanced", "release": "r-1", "deployed_at": "2026-11-29T10:00:00+00:00"}
GOOD_ROLLOUT = {"counts": {"success": 2, "failed": 1}, "last": {"outcome": "success", "time": 1.7e9}}
GOOD = {"probe": GOOD_PROBE, "state": GOOD_STATE, "rollout": GOOD_ROLLOUT}

# Ways a state file goes bad: bytes on disk, or something that is not a file at all.
BROKEN: dict[str, bytes | str] = {
    "empty": b"",
    "truncated": json.dumps(GOOD_PROBE).encode()[:40],
    "not UTF-8": b'{"ok": "\xff\xfe"}',
    "nested 100k": b"[" * 100_000 + b"]" * 100_000,
    "5000-digit int": b'{"time": ' + b"9" * 5000 + b"}",
    "a list": b"[1, 2, 3]",
    "null": b"null",
    "probe: figures a list": json.dumps({**GOOD_PROBE, "figures": [1, 2]}).encode(),
    "probe: handshake a string": json.dumps({**GOOD_PROBE, "handshake": "ok"}).encode(),
    "rollout: counts a list": json.dumps({**GOOD_ROLLOUT, "counts": [1, 2]}).encode(),
    "rollout: count a string": json.dumps({**GOOD_ROLLOUT, "counts": {"success": "two"}}).encode(),
    "rollout: count negative": json.dumps({**GOOD_ROLLOUT, "counts": {"failed": -1}}).encode(),
    "rollout: count 10**400": b'{"counts": {"success": 1' + b"0" * 400 + b"}}",
    "rollout: last a number": json.dumps({**GOOD_ROLLOUT, "last": 5}).encode(),
    "FIFO": "fifo",
    "-> /dev/zero": "zero",
    "a directory": "dir",
    "sparse 5 MB": "giant",
}
# Odd values that are still readable: the file's series stay (values it cannot use are left out).
ODD: dict[str, dict] = {
    "time NaN": {**GOOD_PROBE, "time": float("nan")},
    "accept Infinity": {**GOOD_PROBE, "figures": {"accept_length": float("inf")}},
    "widths as strings": {**GOOD_PROBE, "handshake": {"status": "ok", "expected_hidden_width": "25600"}},
    "time 10**400": {**GOOD_PROBE, "time": 10**400},
    "deployed_at garbage": {**GOOD_STATE, "deployed_at": "yesterday-ish"},
    "profile nested": {**GOOD_STATE, "profile": {"a": [1, {"b": None}]}},
    "unicode release": {**GOOD_STATE, "release": "r-🚀\n\"quoted\""},
}


def _write(path: Path, content: bytes | str | dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, dict):
        path.write_text(json.dumps(content))  # Python writes NaN/Infinity: a careless writer
    elif content == "fifo":
        os.mkfifo(path)
    elif content == "zero":
        path.symlink_to("/dev/zero")
    elif content == "dir":
        path.mkdir()
    elif content == "giant":
        with open(path, "wb") as fh:
            fh.truncate(5 * 1024 * 1024)
    else:
        path.write_bytes(content)


def _host(root: Path, seed: int) -> tuple[dict[str, str], set[str]]:
    """Three healthy units plus one or two units whose files are broken or odd; returns
    {file: what was done} for the broken files and the units that must keep all their series."""
    rng = random.Random(seed)
    for unit in ("sglang-qwen", "sglang-qwen-shadow", "svc-a"):
        for sub, doc in GOOD.items():
            _write(root / sub / f"{unit}.json", doc)
    broken: dict[str, str] = {}
    for i in range(rng.choice((1, 2))):
        unit, sub = f"bad-{seed}-{i}", rng.choice(sorted(GOOD))
        for other, doc in GOOD.items():
            if other != sub:
                _write(root / other / f"{unit}.json", doc)
        if rng.random() < 0.25:
            name = rng.choice(sorted(ODD))
            _write(root / sub / f"{unit}.json", ODD[name])
        else:  # a defect for any file, or one for this kind of file
            name = rng.choice([n for n in sorted(BROKEN) if ": " not in n or n.startswith(f"{sub}: ")])
            _write(root / sub / f"{unit}.json", BROKEN[name])
            broken[f"{sub}/{unit}.json"] = name
    return broken, {"sglang-qwen", "sglang-qwen-shadow", "svc-a"}


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _healthy_series_present(s: dict, units: set[str]) -> None:
    for unit in units:
        u = ("unit", unit)
        assert s[("ddtree_probe_success", (("probe", "live"), u))] == 1.0
        assert s[("ddtree_spec_accept_length", (u,))] == 3.5
        assert s[("ddtree_deploy_info", (("profile", "balanced"), ("release", "r-1"), u))] == 1.0
        assert s[("ddtree_rollouts_total", (("outcome", "success"), u))] == 2.0


@pytest.mark.parametrize("seed", range(40))
def test_collector_skips_and_names_broken_files(seed: int, tmp_path: Path) -> None:
    broken, healthy = _host(tmp_path, seed)
    collector = metrics.DDTreeCollector(str(tmp_path), systemd=False)
    started = time.monotonic()
    text = metrics.generate_latest(metrics.build_registry(collector=collector)).decode()
    assert time.monotonic() - started < 5
    s = _samples(text)
    _healthy_series_present(s, healthy)
    assert set(collector.bad_files) == set(broken), (broken, collector.bad_files)
    named = {dict(labels)["file"] for (name, labels) in s if name == "ddtree_state_file_unreadable"}
    assert named == set(broken)
    for file in broken:  # the broken file's own series are absent, the unit's other files still count
        sub, unit = file.split("/")[0], file.split("/")[1].removesuffix(".json")
        mine = {name for name, labels in s if ("unit", unit) in labels}
        if sub == "probe":
            assert "ddtree_probe_success" not in mine and "ddtree_deploy_info" in mine
        elif sub == "state":
            assert "ddtree_deploy_info" not in mine and "ddtree_probe_success" in mine
        else:
            assert "ddtree_rollouts_total" not in mine and "ddtree_probe_success" in mine


def test_textfile_cli_writes_the_good_series_and_names_the_bad_file(tmp_path: Path) -> None:
    root, out = tmp_path / "state", tmp_path / "textfile"
    _, healthy = _host(root, 3)
    _write(root / "probe" / "torn.json", b'{"probe": "live", "ok": tr')
    cmd = [sys.executable, "-m", "ddtree_runtime", "metrics", "textfile", "--state-dir", str(root),
           "--textfile-dir", str(out), "--no-systemd"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert "skipped probe/torn.json" in res.stderr and "not valid JSON" in res.stderr
    s = _samples((out / metrics.TEXTFILE_NAME).read_text())
    _healthy_series_present(s, healthy)
    assert [p.name for p in out.iterdir()] == [metrics.TEXTFILE_NAME]  # written whole, no temp file left


def test_exporter_keeps_answering_200_with_a_broken_file(tmp_path: Path) -> None:
    _, healthy = _host(tmp_path, 5)
    _write(tmp_path / "rollout" / "torn.json", b"\x00\x01garbage")
    port = free_port()
    cmd = [sys.executable, "-m", "ddtree_runtime", "metrics", "serve", "--state-dir", str(tmp_path),
           "--listen", f"127.0.0.1:{port}", "--no-systemd"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                    status, text = resp.status, resp.read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "the exporter did not start"
                time.sleep(0.1)
        assert status == 200
        s = _samples(text)
        _healthy_series_present(s, healthy)
        named = [dict(labels) for name, labels in s if name == "ddtree_state_file_unreadable"]
        assert any(d["file"] == "rollout/torn.json" and "not valid JSON" in d["reason"] for d in named)
    finally:
        proc.terminate()
        proc.wait(10)


def test_record_rollout_over_a_broken_file_keeps_it_aside_and_counts(tmp_path: Path) -> None:
    path = tmp_path / "rollout" / "sglang-qwen.json"
    _write(path, b"{torn")
    doc = metrics.record_rollout(str(tmp_path), "sglang-qwen", "success", release="r-2")
    assert doc["counts"] == {"success": 1}
    assert json.loads(path.read_text())["counts"] == {"success": 1}
    (aside,) = path.parent.glob("sglang-qwen.json.bad-*")
    assert aside.read_bytes() == b"{torn"  # nothing lost


@pytest.mark.parametrize("unit", ["../../etc/passwd", "a/b", "", "x" * 300])
def test_record_refuses_unit_names_that_are_paths(unit: str, tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "ddtree_runtime", "metrics", "record-rollout", "--state-dir",
                          str(tmp_path), "--unit", unit, "--outcome", "success"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "not a systemd unit name" in res.stderr and "Traceback" not in res.stderr
    assert not any(tmp_path.rglob("*.json"))
