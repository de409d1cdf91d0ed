"""Release naming: the id is the content of the ddtree-runtime wheel plus the pins, nothing else."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit._ansible import REPO

# The runtime role runs it as `python -m` in the controller environment (the checkout first on the path).
BUILD = ["-m", "ddtree_runtime.ops.build_release"]


@pytest.fixture
def checkout(tmp_path) -> Path:
    src = tmp_path / "checkout"
    (src / "ddtree_runtime").mkdir(parents=True)
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "ddtree-runtime"\nversion = "0.1.0"\n'
        '[tool.setuptools.packages.find]\ninclude = ["ddtree_runtime*"]\n'
    )
    (src / "ddtree_runtime/__init__.py").write_text("VALUE = 1\n")
    return src


def build(src: Path, out: Path, *pins: str) -> dict:
    cmd = [sys.executable, *BUILD, "--source", str(src), "--out", str(out), *(f"--pin={p}" for p in pins)]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_same_checkout_same_release(checkout, tmp_path):
    first = build(checkout, tmp_path / "out", "sglang==0.5.23")
    # A fresh copy of the same files (new mtimes, stray caches) names the same release.
    copy = tmp_path / "copy"
    shutil.copytree(checkout, copy)
    (copy / "ddtree_runtime/__pycache__").mkdir()
    (copy / "ddtree_runtime/__pycache__/x.pyc").write_bytes(b"junk")
    second = build(copy, tmp_path / "out2", "sglang==0.5.23")
    assert first["release_id"] == second["release_id"]
    assert Path(first["wheel"]).name == first["wheel_name"] and Path(first["wheel"]).is_file()
    assert Path(first["wheel"]).parent.name == first["release_id"]


def test_changed_code_or_pins_name_a_new_release(checkout, tmp_path):
    base = build(checkout, tmp_path / "out", "sglang==0.5.23")["release_id"]
    assert build(checkout, tmp_path / "out", "sglang==0.5.22")["release_id"] != base
    (checkout / "ddtree_runtime/__init__.py").write_text("VALUE = 2\n")
    assert build(checkout, tmp_path / "out", "sglang==0.5.23")["release_id"] != base


def test_not_a_checkout_is_refused(tmp_path):
    cmd = [sys.executable, *BUILD, "--source", str(tmp_path), "--out", str(tmp_path / "o")]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert result.returncode != 0
    assert "no pyproject.toml" in result.stderr


def test_a_build_is_remembered_until_a_source_or_its_wheel_changes(checkout, tmp_path):
    out = tmp_path / "out"
    first = build(checkout, out, "sglang==0.5.23")
    wheel = Path(first["wheel"])
    stamp = wheel.stat().st_mtime_ns
    # Same sources: the earlier result, and the wheel is not rebuilt or rewritten.
    assert build(checkout, out, "sglang==0.5.23") == first
    assert wheel.stat().st_mtime_ns == stamp
    assert len(list((out / ".built").glob("*.json"))) == 1
    # A wheel that changed on disk is not trusted: built again, same content, same id.
    wheel.write_bytes(b"not a wheel")
    again = build(checkout, out, "sglang==0.5.23")
    assert again["release_id"] == first["release_id"] and again["wheel_sha256"] == first["wheel_sha256"]
    # A changed source (even one that keeps its size) is a new build.
    (checkout / "ddtree_runtime/__init__.py").write_text("VALUE = 3\n")
    assert build(checkout, out, "sglang==0.5.23")["release_id"] != first["release_id"]
