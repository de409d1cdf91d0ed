"""One play over hosts whose releases are built differently: each host gets its own build.

ct131 (the real-SGLang CPU host) adds the lab-only compatibility layer to its release; ct129 does not.
The controller builds each distinct release once per batch, and each host installs its own; a build
made once for the first host (what `run_once` alone would do) would give both the same release.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.lab.conftest import LabHandle

pytestmark = pytest.mark.lab


def _named_release(out: str, host: str) -> dict:
    """The ddtree_runtime_release fact the role set on ``host`` (`-v` prints set_fact's facts)."""
    task = out[out.index("TASK [ddtree_runtime : Name the release]") :]
    line = re.search(rf"^ok: \[{host}\] => (\{{.*\}})$", task, re.M)
    assert line, task[:3000]
    return json.loads(line.group(1))["ansible_facts"]["ddtree_runtime_release"]


def test_each_host_of_a_batch_gets_the_release_built_for_it(lab: LabHandle, wheelhouse) -> None:
    proc = lab.ansible_playbook("deploy.yml", "-l", "ct129,ct131", "--check", "-v", "-e", "serial=2")
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    build = out[out.index("TASK [ddtree_runtime : Build the ddtree-runtime wheel") :]
    build = build[: build.index("TASK [", 10)]
    # One controller task, two builds.
    assert re.findall(r"ok: \[ct129 -> localhost\] => \(item=(.*?)\)", build) == [
        "ddtree-runtime", "ddtree-runtime + sglang-lab-base + sglang-cpu-lab"]  # fmt: skip
    plain, cpu = _named_release(out, "ct129"), _named_release(out, "ct131")
    assert plain["release_id"] != cpu["release_id"]
    assert plain["extra_wheels"] == []
    assert [w["wheel_name"].split("-")[0] for w in cpu["extra_wheels"]] == [
        "ddtree_sglang_lab_base", "ddtree_sglang_cpu_lab"]  # fmt: skip
