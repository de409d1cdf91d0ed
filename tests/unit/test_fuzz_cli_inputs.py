"""The other host-side commands an operator types at 3 a.m., with careless arguments: one line on stderr
(or one report), the documented exit code (2 = bad input), no traceback, no hang."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _ddtree(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    started = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "ddtree_runtime", *args], input=stdin, capture_output=True,
                         timeout=30)
    assert time.monotonic() - started < 20
    assert b"Traceback" not in res.stdout + res.stderr, res.stderr.decode(errors="replace")
    return res


@pytest.fixture
def odd_files(tmp_path: Path) -> dict[str, Path]:
    fifo, zero, garbage = tmp_path / "fifo", tmp_path / "zero", tmp_path / "garbage.log"
    os.mkfifo(fifo)
    zero.symlink_to("/dev/zero")
    noise = bytes(random.Random(1).randrange(256) for _ in range(200_000))
    garbage.write_bytes(noise + b"\nAddress already in use\n")
    return {"fifo": fifo, "zero": zero, "dir": tmp_path, "garbage": garbage, "missing": tmp_path / "nope"}


@pytest.mark.parametrize("kind", ["fifo", "zero", "dir", "missing"])
def test_diagnose_refuses_what_is_not_a_journal_file(odd_files: dict[str, Path], kind: str) -> None:
    res = _ddtree("diagnose", "--journal", str(odd_files[kind]))
    assert res.returncode == 2 and res.stderr.decode().startswith("ddtree diagnose: cannot read the journal")
    assert res.stderr.decode().count("\n") == 1


def test_diagnose_reads_binary_garbage_and_still_names_the_failure(odd_files: dict[str, Path]) -> None:
    res = _ddtree("diagnose", "--journal", str(odd_files["garbage"]), "--json")
    assert res.returncode == 1 and b"port_in_use" in res.stdout
    res = _ddtree("diagnose", "--journal", "-", stdin=odd_files["garbage"].read_bytes())
    assert res.returncode == 1 and b"port_in_use" in res.stdout


@pytest.mark.parametrize("args", [
    ["metrics", "serve", "--listen", "127.0.0.1:99999"], ["metrics", "serve", "--listen", "abc"],
    ["metrics", "serve", "--listen", "127.0.0.1:-1"], ["metrics", "textfile"],
    ["metrics", "record-rollout", "--unit", "x", "--outcome", "exploded"],
    ["metrics", "record-probe", "--unit", "x", "--report", "/dev/zero"],
    ["probe"], ["probe", "static"], ["probe", "static", "--model-path", "", "--draft-model-path", ""],
    ["probe", "live"], ["probe", "live", "--url", "http://127.0.0.1:1", "--timeout", "abc"],
    ["diagnose"],
])
def test_bad_arguments_exit_2(args: list[str], tmp_path: Path) -> None:
    state = ["--state-dir", str(tmp_path)] if args[0] == "metrics" and len(args) > 1 else []
    res = _ddtree(*args, *state)
    assert res.returncode == 2, (args, res.stdout[-500:], res.stderr[-500:])
