"""`ddtree diagnose` on hostile input (issue 23, class 7): a plan file that is a FIFO, nested without end or
malformed is bad input (exit 2, one line); a 2 MB journal built to make the patterns backtrack is scanned
in one pass and still names the failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddtree_runtime.health import diagnose

OOM = "Not enough memory. Please try to increase --mem-fraction-static (mem_fraction_static=0.5)"


def _diagnose(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddtree_runtime", "diagnose", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def journal(tmp_path: Path) -> Path:
    path = tmp_path / "journal.txt"
    path.write_text(OOM + "\n")
    return path


@pytest.mark.parametrize("plan", ["fifo", "nested", "list", "huge", "binary"])
def test_a_plan_that_is_not_a_plan_is_bad_input(tmp_path, journal, plan):
    path = tmp_path / "plan"
    if plan == "fifo":
        os.mkfifo(path)
    elif plan == "nested":
        path.write_text("[" * 200_000 + "]" * 200_000)
    elif plan == "list":
        path.write_text("[1, 2]")
    elif plan == "huge":
        path.write_bytes(b" " * (diagnose.MAX_PLAN_BYTES + 10))
    else:
        path.write_bytes(bytes(range(256)) * 100)
    res = _diagnose("--journal", str(journal), "--plan", str(path))
    assert res.returncode == 2 and res.stderr.startswith("ddtree diagnose: cannot read the plan")
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


@pytest.mark.parametrize(
    "plan",
    [
        {"terms": 5, "changes": "x", "verdict": []},
        {
            "terms": [{"key": "kv_cache"}],
            "changes": [{"flags": {}}],
            "verdict": {"fits": False, "message": ["m"]},
        },
        {"terms": [{"key": "kv_cache", "label": "KV cache", "gib": "lots"}]},
    ],
)
def test_a_malformed_plan_adds_nothing_instead_of_failing(tmp_path, journal, plan):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    res = _diagnose("--journal", str(journal), "--plan", str(path), "--json")
    assert res.returncode == 1, res.stderr
    (finding,) = json.loads(res.stdout)["findings"]
    assert finding["cause"] == "mem_fraction_too_small" and "Planned:" not in finding["summary"]


BACKTRACKERS = [
    "drafter expects [N, 5120] ",
    "target aux hidden capture ",
    "expects target hidden states ",
    "[N, 25600] hidden_width_mismatch ",
    "Capture cuda graph ",
]


def test_a_journal_built_to_backtrack_is_scanned_in_one_pass():
    """Every pattern with a gap, its first part repeated over 2 MB without the rest. With the old regexes
    this took minutes; one pass is a fraction of a second. The bound is a hang guard, not a speed claim."""
    lines = [(prefix * (400_000 // len(prefix))).strip() for prefix in BACKTRACKERS]
    text = "\n".join(
        lines
        + ["CUDA out of memory", OOM, "hidden_width_mismatch: drafter expects [N, 25600] but got [N, 5120]"]
        * 1
    )
    assert len(text) > 2_000_000
    started = time.monotonic()
    findings = diagnose.scan(text)
    assert time.monotonic() - started < 10
    causes = [f.cause for f in findings]
    assert (
        causes[:2] == ["mem_fraction_too_small", "hidden_width_mismatch"] and "cuda_out_of_memory" in causes
    )
    width = next(f for f in findings if f.cause == "hidden_width_mismatch")
    assert "(expected width 25600, got 5120)" in width.summary


def test_split_patterns_match_what_the_regexes_matched():
    for line in (
        "DFLASH drafter expects [N, 25600] from the target but got [N, 5120]",
        "target aux hidden capture returned: got None",
        "Capture decode CUDA graph begin. This can take up to several minutes.",
    ):
        assert diagnose.scan(line + "\nCUDA out of memory" if "Capture" in line else line), line
    assert not diagnose.scan("drafter expects [N, 25600]")  # the second part is required
