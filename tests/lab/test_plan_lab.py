"""The fit check on real lab hosts through ansible-playbook: a profile that does not fit is refused
before anything on the host changes, in seconds; the canary plans its shadow inside what live leaves.

ct129 declares two RTX A6000 (inventories/lab/host_vars/ct129.yml). The model files are
Qwen3.6-27B-shaped: configs plus header-only safetensors (every tensor's shape, no data, a few
hundred KB), copied to the host, so the planner reads on the host what it would read for the real
checkpoint. The "fits" verdict runs in every lab deploy (the lab's models on the declared GPUs;
test_deploy_rollout's --check run asserts the plan is shown).

Each test sets up what its play reads before the plan (issue 42: run alone on a fresh lab, the canary
stopped at the play's first check): the wheelhouse the runtime role's preflight checks, the model files,
and for the canary live's deployed state, recorded as the service role records it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.fixtures_models import write_full_checkpoint_pair
from tests.lab.conftest import REPO

# In a parallel run, one worker runs this module with the rest of tests/conftest.py's lab-engine group, in
# file order on one lab: they share what a module deploys on ct129/ct130 (build A installs once).
pytestmark = pytest.mark.lab

HOST = "ct129"
REMOTE = "/srv/ddtree-plan-test"
STATE = "/var/lib/ddtree/state/sglang-qwen.json"
WATCHED = ("/etc/systemd/system/sglang-qwen.service", "/etc/sglang/sglang-qwen.env", STATE,
           "/etc/systemd/system/sglang-qwen-shadow.service")


PROFILES = REPO / "roles/sglang_service/vars/profiles.yml"


@pytest.fixture(scope="module")
def big_models(lab, wheelhouse, tmp_path_factory) -> tuple[str, str]:
    """The model files on the host; the wheelhouse filled (each play's runtime preflight checks it)."""
    target, draft = write_full_checkpoint_pair(tmp_path_factory.mktemp("qwen36"), "qwen3.6-27b")
    for local, name in ((target, "target"), (draft, "draft")):
        proc = lab.ansible(HOST, "-m", "ansible.builtin.copy", "-a",
                           f"src={local}/ dest={REMOTE}/{name}/ mode=0644")
        assert proc.returncode == 0, proc.stdout[-2000:]
    yield f"{REMOTE}/target", f"{REMOTE}/draft"
    lab.ssh(HOST, f"rm -rf {REMOTE}")


def snapshot(lab) -> str:
    """What a refused rollout must not touch: unit, env, state and shadow files, releases, the service."""
    cmd = (f"for f in {' '.join(WATCHED)}; do [ -e $f ] && sha256sum $f || echo absent $f; done; "
           "ls /opt/ddtree/releases 2>/dev/null; "
           "systemctl show sglang-qwen -p ActiveState,ExecMainStartTimestamp; "
           "systemctl show sglang-qwen-shadow -p ActiveState")
    proc = lab.ssh(HOST, cmd)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def flat(text: str) -> str:
    return " ".join(text.replace("\\n", " ").split())


def test_deploy_refuses_a_profile_that_does_not_fit_before_touching_the_host(lab, big_models):
    target, draft = big_models
    before = snapshot(lab)
    started = time.monotonic()
    proc = lab.ansible_playbook("deploy.yml", "-l", HOST, "-e", "sglang_profile=balanced",
                               "-e", f"sglang_model_path={target}", "-e", f"sglang_draft_model_path={draft}")
    took = time.monotonic() - started
    assert proc.returncode != 0, proc.stdout[-3000:]
    out = flat(proc.stdout)
    assert f"Profile balanced does not fit {HOST}'s GPUs (inventory)" in out
    assert "do not fit in the 46.8 GiB the GPU has" in out
    assert "Smallest change that fits: tp-size 1 -> 2" in out
    assert "Profiles that fit as they are: balanced-tp2" in out
    assert '"  verdict: DOES NOT FIT: target weights by' in proc.stdout  # the table, before the refusal
    assert "Roll out one host" not in proc.stdout  # the rollout play never started
    assert snapshot(lab) == before
    assert took < 60, took
    print(json.dumps({"scenario": "plan_refused_deploy", "seconds": round(took, 1)}))


@pytest.fixture
def live_on_balanced(lab) -> Iterator[None]:
    """What the canary reads of live before it plans: live's deployed state, as the service role records
    it (sglang_service/tasks/run.yml), live on `balanced` on port 30000. A state the host already has
    (another module deployed ct129) is kept aside and put back, so the plan never depends on it."""
    flags = yaml.safe_load(PROFILES.read_text())["sglang_service_profiles"]["balanced"]["flags"]
    release = "0123456789abcdef"  # a release id as the runtime role names them; the plan reads none of it
    state = {"unit": "sglang-qwen", "profile": "balanced", "port": 30000, "release": release,
             "release_dir": f"/opt/ddtree/releases/{release}", "previous_release": None,
             "deployed_at": "2026-12-05T00:00:00Z", "flags": flags}  # fmt: skip
    kept = f"{STATE}.test-plan-lab"
    had = lab.ssh(HOST, f"test -e {STATE}").returncode == 0
    put = lab.ssh(HOST, (f"cp -p {STATE} {kept} && " if had else "")
                  + f"mkdir -p {Path(STATE).parent} && echo '{json.dumps(state)}' > {STATE}")  # fmt: skip
    assert put.returncode == 0, put.stderr
    yield
    back = lab.ssh(HOST, f"mv {kept} {STATE}" if had else f"rm -f {STATE}")
    assert back.returncode == 0, back.stderr


def test_canary_plans_the_shadow_inside_what_live_leaves(lab, big_models, live_on_balanced):
    """Live (balanced) claims nearly all of GPU 0: a shadow of the same model cannot share it."""
    target, draft = big_models
    before = snapshot(lab)
    started = time.monotonic()
    # the shadow on live's own GPU (the lab puts shadows on GPU 1 otherwise)
    proc = lab.ansible_playbook("ansible/canary.yml", "-l", HOST, "-e", "canary_shadow_profile=shadow",
                                "-e", "canary_shadow_cuda_visible_devices=",
                                "-e", f"sglang_model_path={target}",
                                "-e", f"sglang_draft_model_path={draft}")
    took = time.monotonic() - started
    assert proc.returncode != 0, proc.stdout[-3000:]
    out = flat(proc.stdout)
    assert "beside the live service (" in out and "which holds" in out and "on GPU 0" in out
    assert f"Profile shadow does not fit {HOST}'s GPUs" in out
    assert "Canary one host" not in proc.stdout
    assert snapshot(lab) == before
    print(json.dumps({"scenario": "plan_refused_canary", "seconds": round(took, 1)}))
