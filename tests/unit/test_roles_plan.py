"""The deploy's fit check through the real ansible-playbook (localhost): both verdicts, and the refusals.

Qwen3.6-27B-shaped files (header-only checkpoints) are read by model_files.py through Ansible's script
module, exactly as on a host; this machine has no nvidia-smi, so the GPUs are the inventory's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.fixtures_models import write_full_checkpoint_pair
from tests.unit._ansible import PLAYBOOKS, REPO, playbook

A6000S = json.dumps({"ddtree_gpus": [{"name": "NVIDIA RTX A6000", "count": 2}]})
H200 = json.dumps({"ddtree_gpus": [{"name": "NVIDIA H200", "count": 1}]})


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_full_checkpoint_pair(tmp_path_factory.mktemp("qwen36"), "qwen3.6-27b")


def run(models: tuple[Path, Path], *extra: str):
    target, draft = models
    args = ["-e", f"sglang_model_path={target}", "-e", f"sglang_draft_model_path={draft}"]
    for e in extra:
        args += ["-e", e]
    return playbook(PLAYBOOKS / "fit.yml", *args)


def flat(text: str) -> str:
    return " ".join(text.replace("\\n", " ").split())


def test_a_profile_that_does_not_fit_is_refused_with_the_plan_and_the_fix(models):
    result = run(models, A6000S, "sglang_profile=balanced")
    assert result.returncode != 0
    out = flat(result.stdout)
    assert "Profile balanced does not fit localhost's GPUs (inventory)" in out
    assert "do not fit in the 46.8 GiB the GPU has" in out
    assert "Smallest change that fits: tp-size 1 -> 2" in out
    assert "Profiles that fit as they are: balanced-tp2" in out
    assert "Nothing on the host was changed" in out
    # the table came first, term by term
    for text in ('"  verdict: DOES NOT FIT: target weights by', "target weights", "2 x NVIDIA RTX A6000"):
        assert text in result.stdout


def test_a_profile_that_fits_passes_and_shows_its_plan(models):
    result = run(models, A6000S, "sglang_profile=balanced-tp2")
    assert result.returncode == 0, result.stdout[-3000:]
    assert '"  verdict: FITS"' in result.stdout
    assert "tp-size 2 -> GPU 0,1" in result.stdout


def test_a_shadow_is_planned_inside_what_live_leaves(models):
    profiles = yaml.safe_load((REPO / "roles/sglang_service/vars/profiles.yml").read_text())
    flags = profiles["sglang_service_profiles"]["balanced"]["flags"]
    live = json.dumps({"sglang_service_plan_beside": {"profile": "balanced", "flags": flags}})
    result = run(models, H200, "sglang_profile=shadow-small", live)
    assert result.returncode != 0
    out = flat(result.stdout)
    assert "beside the live service (balanced), which holds" in out
    assert "Profile shadow-small does not fit" in out


def test_unknown_gpus_and_unreadable_models_are_refused_before_any_change(models, tmp_path):
    result = run(models, "sglang_profile=balanced")  # no ddtree_gpus, no nvidia-smi here
    assert result.returncode != 0
    assert "there is no nvidia-smi and the inventory declares no ddtree_gpus" in flat(result.stdout)
    result = run((tmp_path / "nope", models[1]), H200, "sglang_profile=balanced")
    assert result.returncode != 0
    assert "the model files could not be read" in flat(result.stdout) and "does not exist" in result.stdout
    result = run(models, "sglang_profile=balanced", "sglang_service_plan=false")
    assert result.returncode == 0, result.stdout[-2000:]
