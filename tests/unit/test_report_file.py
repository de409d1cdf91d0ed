"""health.report_file: the one JSON writer of the probe, the canary and the metrics state."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from ddtree_runtime.health.report_file import write_json_atomic


def test_writes_strict_json_with_its_parents_readable_by_all(tmp_path: Path) -> None:
    target = tmp_path / "probe" / "sglang-qwen.json"
    write_json_atomic({"ok": True, "accept_length": 4.0}, target)
    assert json.loads(target.read_text()) == {"ok": True, "accept_length": 4.0}
    assert os.stat(target).st_mode & 0o777 == 0o644
    assert [p.name for p in target.parent.iterdir()] == ["sglang-qwen.json"]  # no temp file left


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_figure_is_refused_and_the_previous_report_kept(tmp_path: Path, bad: float) -> None:
    target = tmp_path / "canary.json"
    write_json_atomic({"ratio": 1.0}, target)
    with pytest.raises(ValueError):
        write_json_atomic({"ratio": bad}, target)
    assert json.loads(target.read_text()) == {"ratio": 1.0}
    assert [p.name for p in tmp_path.iterdir()] == ["canary.json"]


def test_a_failed_write_leaves_no_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(src: str, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        write_json_atomic({"ok": False}, tmp_path / "state.json")
    assert list(tmp_path.iterdir()) == []
