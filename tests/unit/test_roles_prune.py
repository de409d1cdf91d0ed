"""Release pruning keeps the newest N and never removes a release a unit or a rollback snapshot points at."""

from __future__ import annotations

import os
from pathlib import Path

from tests.unit._ansible import PLAYBOOKS, playbook


def make_release(root: Path, rid: str, age_s: int) -> None:
    path = root / "releases" / rid
    path.mkdir(parents=True)
    (path / "release.json").write_text("{}")
    (root / "wheels" / rid).mkdir(parents=True)
    stamp = 1_700_000_000 - age_s
    os.utime(path, (stamp, stamp))


def test_prune_keeps_newest_and_referenced(tmp_path):
    root = tmp_path / "ddtree"
    ids = [f"{i:016x}" for i in range(1, 7)]  # ids[0] newest ... ids[5] oldest
    for age, rid in enumerate(ids):
        make_release(root, rid, age * 100)
    deploying, live_old = ids[0], ids[5]
    units = tmp_path / "units"
    units.mkdir()
    (units / "sglang-qwen.service").write_text(f"ExecStart={root}/releases/{live_old}/bin/python -m x\n")
    snapshots = tmp_path / "rollback"
    (snapshots / "sglang-qwen").mkdir(parents=True)
    (snapshots / "sglang-qwen" / "unit").write_text(f"ExecStart={root}/releases/{ids[4]}/bin/python\n")

    args = ["-e", f"ddtree_runtime_root={root}",
            "-e", f"ddtree_runtime_release_dir={root}/releases/{deploying}",
            "-e", "ddtree_runtime_keep_releases=1",
            "-e", f'{{"ddtree_runtime_reference_paths": ["{units}", "{snapshots}"]}}']
    result = playbook(PLAYBOOKS / "prune.yml", *args)
    assert result.returncode == 0, result.stdout[-3000:]
    left = sorted(p.name for p in (root / "releases").iterdir())
    # deploying (ids[0]) + newest other (ids[1]) + the live unit's and the snapshot's releases.
    assert left == sorted([ids[0], ids[1], ids[4], ids[5]])
    assert sorted(p.name for p in (root / "wheels").iterdir()) == left

    again = playbook(PLAYBOOKS / "prune.yml", *args)
    assert again.returncode == 0
    assert "changed=0" in again.stdout
