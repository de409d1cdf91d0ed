"""Preflight refuses bad input before any change, naming the valid choices (real ansible-playbook)."""

from __future__ import annotations

import json

import pytest

from tests.unit._ansible import PLAYBOOKS, REPO, playbook


def run(*extra: str):
    args: list[str] = ["-e", f"ddtree_runtime_source_dir={REPO}"]
    for e in extra:
        args += ["-e", e]
    return playbook(PLAYBOOKS / "preflight.yml", *args)


def test_known_profile_passes():
    result = run("sglang_profile=shadow-small")
    assert result.returncode == 0, result.stdout[-3000:]


@pytest.mark.parametrize("budget", ["auto", "15,31"])
def test_a_host_may_run_adaptive_widths(budget):
    result = run("sglang_profile=shadow", json.dumps({"sglang_service_flag_overrides":
                                                      {"speculative-ddtree-budget": budget}}))
    assert result.returncode == 0, result.stdout[-3000:]


def test_preflight_checks_the_checkout():
    # A folder that is no checkout (the wheel's source defaults to the checkout the roles are in).
    result = playbook(PLAYBOOKS / "preflight.yml", "-e", f"ddtree_runtime_source_dir={PLAYBOOKS}")
    assert result.returncode != 0
    assert "pyproject.toml not found: run ansible-playbook from the checkout" in result.stdout


def test_unknown_profile_names_the_valid_choices():
    result = run("sglang_profile=turbo")
    assert result.returncode != 0
    # The role's argument spec refuses it first (Ansible's own message, with the choices).
    assert ("sglang_service_profile must be one of: balanced, balanced-tp2, shadow, shadow-small, "
            "shadow-small-nograph, got: turbo") in result.stdout


def test_removed_flag_spelling_is_refused():
    profiles = {"sglang_service_profiles": {"balanced": {"description": "x", "port": 30000,
                                                         "flags": {"cuda-graph-max-bs": 8}}}}
    result = run(json.dumps(profiles), "sglang_profile=balanced")
    assert result.returncode != 0
    assert "no longer accepts" in result.stdout and "cuda-graph-max-bs" in result.stdout


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("sglang_service_port=70000",
         "sglang_service_port: '70000' is out of range: 0..65535 (0 = the profile's port)"),
        ("ddtree_runtime_install_source=ftp", "install_source must be one of: index, wheelhouse"),
        ("ddtree_runtime_keep_releases=0", "ddtree_runtime_keep_releases: '0' is out of range: 1..100"),
        ("ddtree_probe_min_accept_length=0.5",
         "ddtree_probe_min_accept_length: '0.5' is not a number in [1, 1000]"),
        ('{"sglang_extra_env": {"BAD NAME": "x"}}',
         "sglang_service_extra_env key: 'BAD NAME' is not an environment variable name"),
        ('{"sglang_service_sandbox_disable": ["NoSuchDirective"]}', "sandbox_disable only names"),
        ('{"sglang_service_host": "0.0.0.0"}', "SGLang's API has no authentication"),
        # the budget flag (issue 41): a number, auto or a comma list of widths, each once, at most four
        ('{"sglang_service_flag_overrides": {"speculative-ddtree-budget": "auto2"}}',
         "sglang_service_flag_overrides.speculative-ddtree-budget takes a whole number, 'auto' or a comma "
         "list (15,31), got 'auto2'"),
        ('{"sglang_service_flag_overrides": {"speculative-ddtree-budget": "15,15"}}',
         "give 2..4 different budgets, each once"),
        ('{"sglang_service_flag_overrides": {"speculative-ddtree-budget": 0}}',
         "speculative-ddtree-budget: 0 is not a whole number in 1..1023 (verify width = budget + 1)"),
        ('{"sglang_service_flag_overrides": {"speculative-ddtree-budget": "auto", '
         '"speculative-ddtree-topk-cap": 1}}', "the chain, which has one width"),
    ],
)
def test_invalid_variables_are_refused_with_what_to_do(extra, expected):
    result = run(extra)
    assert result.returncode != 0
    assert expected in " ".join(result.stdout.split()), result.stdout[-3000:]


def test_lab_deploy_before_the_wheelhouse_names_the_command(tmp_path):
    """The newcomer trap: a wheelhouse install from an empty or partial wheelhouse fails in the preflight,
    naming what is missing and `ddtree lab wheelhouse`, not deep inside pip on the host."""
    lab = {"ddtree_runtime_install_source": "wheelhouse", "ddtree_runtime_wheelhouse": str(tmp_path),
           "ddtree_runtime_packages": ["torch==2.13.0", "IPython", "apache-tvm-ffi==0.1.11", "numpy"],
           "ddtree_runtime_nodeps_packages": ["sglang==0.5.23"]}
    result = run(json.dumps(lab))
    assert result.returncode != 0
    said = " ".join(result.stdout.split())
    assert f"The wheelhouse {tmp_path} on localhost is empty or missing" in said
    assert "run `ddtree lab wheelhouse` on the controller first" in said
    for name in ("torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "ipython-9.18.1-py3-none-any.whl",
                 "apache_tvm_ffi-0.1.11-cp311-cp311-manylinux_2_28_x86_64.whl",
                 "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl"):
        (tmp_path / name).touch()
    result = run(json.dumps(lab))
    assert result.returncode != 0 and "has no wheel for numpy." in " ".join(result.stdout.split())
    (tmp_path / "numpy-2.4.6-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    result = run(json.dumps(lab))
    assert result.returncode == 0, result.stdout[-3000:]
