"""Careless and hostile operator input on its way to a unit file, an env file, a flag list, a shell or a
path (issue 23, classes 1-3): refused at preflight naming the variable, the value and the rule, or
quoted so that systemd reads back exactly what was meant.

The rules (ddtree_runtime/inputs/) are checked directly, case by case; the roles' use of them
through real ansible-playbook runs (a few, each carrying many cases at once: the check reports every
problem); the rendered files through systemd's own parsers (tests/unit/_systemd.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from ddtree_runtime.inputs import (
    launch_flags,
    role_checks,
    router_flags,
    service_command,
    systemd_quoting,
    values,
)
from tests.unit import _systemd
from tests.unit._ansible import PLAYBOOKS, REPO, playbook

INJECT = "\nExecStartPre=+/bin/sh -c 'id > /tmp/pwned'"
PROFILE = {
    "description": "test",
    "port": 30000,
    "flags": {"tp-size": 1, "mem-fraction-static": 0.85, "disable-cuda-graph": False, "x": None},
}
VALID: dict[str, Any] = {
    "profile": "balanced",
    "profile_data": PROFILE,
    "unit_name": "sglang-qwen",
    "port": 0,
    "effective_port": 30000,
    "host": "127.0.0.1",
    "engine": "sglang",
    "release_dir": "/opt/ddtree/releases/x",
    "model_path": "/srv/models/target",
    "draft_model_path": "/srv/models/draft",
    "speculative_algorithm": "DDTREE",
    "enable_metrics": True,
    "plan": True,
    "extra_flags": ["--log-level info"],
    "flag_overrides": {},
    "engine_env": {},
    "extra_env": {},
    "secret_env": {"HF_TOKEN": "hf_secret"},
    "cuda_visible_devices": "",
    "user": "sglang",
    "group": "sglang",
    "unit_dir": "/etc/systemd/system",
    "env_dir": "/etc/sglang",
    "state_dir": "/var/lib/ddtree/state",
    "rollback_dir": "/var/lib/ddtree/rollback",
    "ready_timeout": 1800,
    "start_timeout": 3600,
    "stop_timeout": 120,
    "stable_s": 60,
    "restart_sec": 30,
    "start_limit_interval": 7200,
    "start_limit_burst": 3,
    "allowed_clients": [],
    "device_allow": ["char-nvidia rwm"],
    "sandbox": {"ProtectSystem": "strict", "CapabilityBoundingSet": ""},
    "sandbox_disable": [],
}


def _named(problems: list[str], variable: str) -> bool:
    return any(p.startswith(variable) for p in problems)


def test_the_defaults_pass_and_render():
    assert role_checks.service_problems(VALID) == []
    argv = service_command.service_argv(VALID)
    assert argv[:3] == ["/opt/ddtree/releases/x/bin/python", "-m", "sglang.launch_server"]
    assert argv[-4:] == ["--host", "127.0.0.1", "--port", "30000"]
    assert (
        "--log-level" in argv and "info" in argv and "--disable-cuda-graph" not in argv and "--x" not in argv
    )


# ---------------------------------------------------------------------------- class 1: directives, env lines


@pytest.mark.parametrize(
    ("override", "variable"),
    [
        ({"extra_flags": ["--log-level info" + INJECT]}, "sglang_service_extra_flags[0]"),
        ({"extra_flags": ["--device cpu --attention-backend torch"]}, "sglang_service_extra_flags[0]"),
        ({"extra_flags": ["-rf"]}, "sglang_service_extra_flags[0]"),
        ({"extra_flags": ["cpu"]}, "sglang_service_extra_flags[0]"),
        ({"extra_flags": "--log-level info"}, "sglang_service_extra_flags"),
        (
            {"flag_overrides": {"context-length": "8192" + INJECT}},
            "sglang_service_flag_overrides.context-length",
        ),
        ({"flag_overrides": {"x\nExecStartPre": 1}}, "sglang_service_flag_overrides key"),
        ({"flag_overrides": {"--tp-size": 2}}, "sglang_service_flag_overrides key"),
        ({"flag_overrides": {"enable-metrics": "false"}}, "sglang_service_flag_overrides.enable-metrics"),
        (
            {"flag_overrides": {"mem-fraction-static": float("nan")}},
            "sglang_service_flag_overrides.mem-fraction",
        ),
        ({"cuda_visible_devices": "0\nLD_PRELOAD=/tmp/evil.so"}, "sglang_service_cuda_visible_devices"),
        ({"cuda_visible_devices": "0, 1"}, "sglang_service_cuda_visible_devices"),
        ({"cuda_visible_devices": "0,00"}, "sglang_service_cuda_visible_devices"),
        ({"unit_name": "sglang-qwen\n"}, "sglang_service_unit_name"),
        ({"unit_name": "sglang-qwen" + INJECT}, "sglang_service_unit_name"),
        ({"unit_name": "sglang-qwen.service"}, "sglang_service_unit_name"),
        ({"extra_env": {"LD_PRELOAD": "x\nLD_PRELOAD=/tmp/evil.so"}}, "sglang_service_extra_env.LD_PRELOAD"),
        ({"extra_env": {"A=B": "x"}}, "sglang_service_extra_env key"),
        ({"extra_env": {"FAULT": True}}, "sglang_service_extra_env.FAULT"),
        ({"engine_env": {"X": "a\rb"}}, "sglang_service_engine_env.X"),
        ({"extra_env": {"X": "a\u2028b"}}, "sglang_service_extra_env.X"),
        ({"extra_env": ["A=1"]}, "sglang_service_extra_env"),
        ({"sandbox": {"ProtectSystem": "strict" + INJECT}}, "sglang_service_sandbox.ProtectSystem"),
        ({"sandbox": {"Protect System": "yes"}}, "sglang_service_sandbox key"),
        ({"device_allow": ["char-nvidia rwm" + INJECT]}, "sglang_service_device_allow"),
        ({"device_allow": ["/dev/sda rwx"]}, "sglang_service_device_allow entry"),
        ({"allowed_clients": ["10.0.0.0/8 ; rm -rf /"]}, "sglang_service_allowed_clients entry"),
        ({"allowed_clients": ["1.2.3.4.5"]}, "sglang_service_allowed_clients entry"),
        ({"profile_data": {**PROFILE, "description": "x" + INJECT}}, "the profile's description"),
        ({"release_dir": "/opt/ddtree/releases/x y"}, "sglang_service_release_dir"),
        ({"env_dir": "/etc/sglang\n"}, "sglang_service_env_dir"),
        ({"model_path": "/srv/models/target\n--enable-p2p-check"}, "sglang_service_model_path"),
        ({"model_path": "relative/model"}, "sglang_service_model_path"),
    ],
)
def test_what_would_become_a_directive_or_an_env_line_is_refused(override, variable):
    problems = role_checks.service_problems({**VALID, **override})
    assert _named(problems, variable), problems


def test_a_secret_value_is_never_shown_in_a_refusal():
    problems = role_checks.service_problems({**VALID, "secret_env": {"HF_TOKEN": "hf_top_secret\nX=1"}})
    assert _named(problems, "sglang_service_secret_env.HF_TOKEN")
    assert "hf_top_secret" not in " ".join(problems) and "(value hidden)" in " ".join(problems)


@pytest.mark.parametrize(
    ("items", "argv"),
    [
        (["--device cpu", "--sleep-on-idle"], ["--device", "cpu", "--sleep-on-idle"]),
        (["--mem-fraction-static", "0.02"], ["--mem-fraction-static", "0.02"]),
        (["--json-model-override-args", '{"a": [1, 2]}'], ["--json-model-override-args", '{"a": [1, 2]}']),
        (["--served-model-name=qwen 27b"], ["--served-model-name=qwen 27b"]),
        (["--max-running-requests", "-1"], ["--max-running-requests", "-1"]),
    ],
)
def test_flag_lists_split_the_way_inventories_write_them(items, argv):
    assert launch_flags.split_launch_flags(items) == argv


def test_a_value_that_would_split_or_expand_is_one_quoted_word():
    for word in (
        "a b",
        'say "hi"',
        "$HOME",
        "${PATH}",
        "100%",
        "%n",
        "back\\slash",
        ";",
        "é☃",
        "`id`",
        "'q'",
    ):
        quoted = systemd_quoting.systemd_word(word)
        assert quoted.startswith('"') or word.isascii() is False, quoted
        assert "$" not in quoted.replace("$$", "") and "%" not in quoted.replace("%%", "")
    with pytest.raises(values.InputError, match="control character"):
        systemd_quoting.systemd_word("a\nb")
    with pytest.raises(values.InputError, match="control character"):
        systemd_quoting.env_file_value("a\x00b")


# ---------------------------------------------------------------------------- class 2: shells and paths


@pytest.mark.parametrize(
    ("override", "variable"),
    [
        ({"live_unit_name": "sglang-qwen; touch /tmp/pwned"}, "sglang_canary_live_unit_name"),
        ({"live_unit_name": "$(id)"}, "sglang_canary_live_unit_name"),
        ({"shadow_unit_name": "../../../../etc"}, "sglang_canary_shadow_unit_name"),
        ({"shadow_unit_name": ".."}, "sglang_canary_shadow_unit_name"),
        ({"shadow_unit_name": "sglang-qwen"}, "sglang_canary_shadow_unit_name"),
        ({"rollback_dir": "/var/lib/ddtree/rollback/.."}, "sglang_canary_rollback_dir"),
        ({"state_dir": "var/lib/ddtree/state"}, "sglang_canary_state_dir"),
        (
            {"shadow_extra_flags": ["--mem-fraction-static 0.5" + INJECT]},
            "sglang_canary_shadow_extra_flags[0]",
        ),
        ({"shadow_cuda_visible_devices": "1,1"}, "sglang_canary_shadow_cuda_visible_devices"),
        ({"shadow_port": -1}, "sglang_canary_shadow_port"),
        ({"rounds": 10**9}, "sglang_canary_rounds"),
        ({"min_accept_ratio": "nan"}, "sglang_canary_min_accept_ratio"),
        ({"require_equal_tokens": "flase"}, "sglang_canary_require_equal_tokens"),
        ({"traffic_s": -1}, "sglang_canary_traffic_s"),
        ({"traffic_requests": 0}, "sglang_canary_traffic_requests"),
        ({"traffic_max_error_rate_increase": "inf"}, "sglang_canary_traffic_max_error_rate_increase"),
    ],
)
def test_canary_values_that_reach_a_shell_or_a_path_are_refused(override, variable):
    valid = {
        "shadow_unit_name": "sglang-qwen-shadow",
        "live_unit_name": "sglang-qwen",
        "shadow_port": 30001,
        "live_port": 0,
        "rounds": 3,
        "max_new_tokens": 32,
        "min_accept_ratio": 0.8,
        "max_latency_ratio": 1.5,
        "latency_slack_s": 0.1,
        "ready_timeout": 120,
        "traffic_s": 300,
        "traffic_requests": 20,
        "traffic_max_error_rate_increase": 0.0,
        "require_equal_tokens": True,
        "prompts": [],
        "shadow_extra_flags": [],
        "shadow_extra_env": {},
        "shadow_cuda_visible_devices": "",
        "release_dir": "",
        "report_dir": "/var/lib/ddtree/canary",
        "unit_dir": "/etc/systemd/system",
        "env_dir": "/etc/sglang",
        "state_dir": "/var/lib/ddtree/state",
        "rollback_dir": "/var/lib/ddtree/rollback",
    }
    assert role_checks.canary_problems(valid) == []
    assert _named(role_checks.canary_problems({**valid, **override}), variable)


ROUTER: dict[str, Any] = {
    "version": "0.3.2",
    "install_source": "index",
    "wheelhouse": "/srv/wheelhouse",
    "pip_index_args": [],
    "root": "/opt/sglang-router",
    "python": "/usr/bin/python3",
    "workers": ["ct129", "ct130"],
    "worker_addresses": ["10.0.4.11", "fd00::12"],
    "listen_address": "0.0.0.0",
    "port": 30080,
    "metrics_listen_address": "127.0.0.1",
    "metrics_port": 29000,
    "allowed_clients": ["10.0.4.0/24"],
    "control_key": "a-control-key-of-24-chars",
    "policy": "cache_aware",
    "health_check_interval_s": 10,
    "health_failure_threshold": 3,
    "request_timeout_s": 1800,
    "shutdown_grace_s": 180,
    "worker_startup_timeout_s": 300,
    "extra_flags": ["--log-level info"],
    "user": "sglang-router",
    "unit_dir": "/etc/systemd/system",
    "env_dir": "/etc/sglang-router",
    "state_dir": "/var/lib/sglang-router",
}


@pytest.mark.parametrize(
    ("override", "variable"),
    [
        ({"version": "0.3.2; curl x | sh"}, "sglang_router_version"),
        ({"root": "/opt/sglang-router/../../etc"}, "sglang_router_root"),
        ({"wheelhouse": "srv/wheelhouse"}, "sglang_router_wheelhouse"),
        ({"pip_index_args": ["--index-url http://x" + INJECT]}, "sglang_router_pip_index_args[0]"),
        ({"listen_address": "0.0.0.0\nExecStartPre=/bin/sh"}, "sglang_router_listen_address"),
        ({"port": 70000}, "sglang_router_port"),
        ({"metrics_port": "29000\n"}, "sglang_router_metrics_port"),
        ({"metrics_port": 30080}, "sglang_router_metrics_port"),
        ({"allowed_clients": ["10.0.4.0/24 0.0.0.0/0"]}, "sglang_router_allowed_clients entry"),
        ({"control_key": "a-control-key-of-24-chars" + INJECT}, "sglang_router_control_key"),
        ({"control_key": "short"}, "sglang_router_control_key"),
        ({"policy": "cache_aware --port 1"}, "sglang_router_policy"),
        ({"health_check_interval_s": 0}, "sglang_router_health_check_interval_s"),
        ({"shutdown_grace_s": "1e9"}, "sglang_router_shutdown_grace_s"),
        ({"extra_flags": ["--log-level info" + INJECT]}, "sglang_router_extra_flags[0]"),
        ({"extra_flags": ["--host=10.9.9.9"]}, "sglang_router_extra_flags[0]"),
        ({"extra_flags": ["--worker-urls http://10.9.9.9:1"]}, "sglang_router_extra_flags[0]"),
        ({"user": "root"}, "sglang_router_user"),
        ({"workers": ["ct129\nct130"]}, "sglang_router_workers[0]"),
        ({"worker_addresses": ["ct129.example"]}, "sglang_router_workers[0]'s address"),
    ],
)
def test_router_values_that_reach_its_unit_or_pip_are_refused(override, variable):
    assert router_flags.router_problems(ROUTER) == []
    problems = router_flags.router_problems({**ROUTER, **override})
    assert _named(problems, variable), problems
    assert not any("a-control-key" in p or "short" in p for p in problems)  # the key never shows


@pytest.mark.parametrize(
    ("override", "variable"),
    [
        ({"enabled": "flase"}, "sglang_rotation_enabled"),
        ({"worker_address": "10.0.4.11/../x"}, "sglang_rotation_worker_address"),
        ({"worker_address": "ct129"}, "sglang_rotation_worker_address"),
        ({"local_address": "127.0.0.1@evil"}, "sglang_rotation_local_address"),
        ({"port": 0}, "sglang_rotation_port"),
        ({"unit": "sglang-qwen; reboot"}, "sglang_rotation_unit"),
        ({"state_dir": "/var/lib/ddtree/state/.."}, "sglang_rotation_state_dir"),
        ({"drain_timeout": -1}, "sglang_rotation_drain_timeout"),
        ({"api_timeout": "10s"}, "sglang_rotation_api_timeout"),
    ],
)
def test_rotation_values_that_reach_a_router_or_a_wait_are_refused(override, variable):
    valid = {"enabled": True, "allow_single_host_downtime": "yes", "routers": ["ct131"],
             "worker_address": "10.0.4.11", "local_address": "127.0.0.1", "port": "30000",
             "shadow_port": 30001, "unit": "sglang-qwen", "state_dir": "/var/lib/ddtree/state",
             "drain_timeout": 600, "join_timeout": 120, "api_timeout": 10}  # fmt: skip
    assert role_checks.rotation_problems(valid) == []
    assert _named(role_checks.rotation_problems({**valid, **override}), variable)


@pytest.mark.parametrize(
    ("state", "field"),
    [
        ({"release": "0123456789abcdef", "previous_release": "../../../etc"}, "previous_release"),
        ({"release": "0123456789abcdef", "previous_release": "0123456789abcdef/../.."}, "previous_release"),
        ({"release_dir": "/opt/ddtree/releases/../../../etc"}, "release_dir"),
        ({"release_dir": "/etc"}, "release_dir"),
        ({"release_dir": "/tmp/x; reboot"}, "release_dir"),
        ({"port": "30000\n"}, "port"),
        ({"profile": "balanced\nx"}, "profile"),
    ],
)
def test_a_recorded_state_cannot_steer_paths_outside_their_directories(state, field):
    problems = role_checks.recorded_state_problems("sglang-qwen.json", state, "/opt/ddtree/releases")
    assert _named(problems, f"sglang-qwen.json {field}"), problems
    good = {
        "release": "0123456789abcdef",
        "previous_release": "fedcba9876543210",
        "port": 30000,
        "release_dir": "/opt/ddtree/releases/0123456789abcdef",
        "profile": "balanced",
    }
    assert role_checks.recorded_state_problems("s", good, "/opt/ddtree/releases") == []


# ---------------------------------------------------------------------------- class 3: argument specs bind


def test_bools_bind_a_string_false_is_false_and_a_typo_is_refused():
    assert "--enable-metrics" not in service_command.service_argv({**VALID, "enable_metrics": "false"})
    assert "--enable-metrics" not in service_command.service_argv({**VALID, "enable_metrics": "no"})
    assert "--enable-metrics" in service_command.service_argv({**VALID, "enable_metrics": "True"})
    assert _named(
        role_checks.service_problems({**VALID, "enable_metrics": "flase"}), "sglang_service_enable_metrics"
    )
    assert _named(role_checks.service_problems({**VALID, "plan": "maybe"}), "sglang_service_plan")


@pytest.mark.parametrize(
    ("override", "variable"),
    [
        ({"port": -5}, "sglang_service_port"),
        ({"port": "30000x"}, "sglang_service_port"),
        ({"port": True}, "sglang_service_port"),
        ({"port": 65536}, "sglang_service_port"),
        ({"profile_data": {**PROFILE, "port": 0}}, "the profile's port"),
        ({"ready_timeout": 0}, "sglang_service_ready_timeout"),
        ({"start_timeout": 60}, "sglang_service_start_timeout"),
        ({"start_limit_burst": 0}, "sglang_service_start_limit_burst"),
        ({"user": "root"}, "sglang_service_user"),
        ({"user": "sglang\n"}, "sglang_service_user"),
        ({"user": "Sglang User"}, "sglang_service_user"),
        ({"group": "root"}, "sglang_service_group"),
    ],
)
def test_ranges_and_accounts_are_checked(override, variable):
    assert _named(role_checks.service_problems({**VALID, **override}), variable)


def test_an_existing_account_the_install_would_rewrite_is_refused():
    home, shell = "/var/lib/sglang", "/usr/sbin/nologin"
    ours = "sglang:x:998:998::/var/lib/sglang:/usr/sbin/nologin"
    assert values.existing_account("u", "sglang", ours, home=home, shell=shell) is None
    assert values.existing_account("u", "sglang", "", home=home, shell=shell) is None  # created by install
    toor = "toor:x:0:0:root:/root:/bin/bash"
    assert "uid 0" in values.existing_account("u", "toor", toor, home=home, shell=shell)
    person = "alice:x:1000:1000:Alice:/home/alice:/bin/bash"
    found = values.existing_account("sglang_service_user", "alice", person, home=home, shell=shell)
    assert found.startswith("sglang_service_user: 'alice' already exists") and "/home/alice" in found


# ------------------------------------------------------------------------ the roles, real ansible-playbook

ODD_MODEL = '/srv/models/Qwen 3.6 "27B" $NOT_A_VAR 100% back\\slash é'
ODD_ENV = {"ODD": 'x y "q" $NOT_A_VAR `id` \\ é ☃ %n', "CUDA_HOME": "/usr/local/cuda"}
ODD_FLAGS = [
    "--log-level info",
    "--json-model-override-args",
    '{"rope": {"factor": 4.0}}',
    "--served-model-name=qwen 27b",
]


@pytest.fixture(scope="module")
def odd_unit(tmp_path_factory) -> Path:
    """The balanced unit and env file, rendered by the role with values that need systemd's quoting."""
    out = tmp_path_factory.mktemp("odd")
    release = out / "release"
    (release / "bin").mkdir(parents=True)
    (release / "bin/python").symlink_to(shutil.which("python3") or "/usr/bin/python3")
    (out / "balanced").mkdir()
    extra = {
        "profiles": ["balanced"],
        "sglang_model_path": ODD_MODEL,
        "sglang_extra_env": ODD_ENV,
        "sglang_extra_flags": ODD_FLAGS,
        "sglang_secret_env": {"HF_TOKEN": 'hf_$ecret"`'},
        "sglang_service_cuda_visible_devices": "0,1",
        "sglang_service_enable_metrics": "false",
    }
    result = playbook(
        PLAYBOOKS / "render_units.yml",
        "-e",
        f"out_dir={out}",
        "-e",
        f"sglang_service_release_dir={release}",
        "-e",
        f"sglang_service_unit_template={REPO}/templates/sglang-qwen.service.j2",
        "-e",
        f"sglang_service_env_template={REPO}/templates/sglang-qwen.env.j2",
        "-e",
        json.dumps(extra),
    )
    assert result.returncode == 0, result.stdout[-3000:]
    return out / "balanced"


@pytest.mark.skipif(_systemd.ANALYZE is None, reason="systemd-analyze not installed")
def test_systemd_reads_back_exactly_the_argv_meant(odd_unit: Path):
    unit = odd_unit / "sglang-qwen.service"
    rc, warnings, _ = _systemd.verify(unit)
    assert rc == 0 and warnings == "", warnings
    argv = _systemd.exec_time_argv(_systemd.exec_start(unit))
    assert argv[argv.index("--model-path") + 1] == ODD_MODEL
    tail = argv[argv.index("--speculative-ddtree-budget") + 2 :]
    assert tail == [
        "--log-level",
        "info",
        "--json-model-override-args",
        '{"rope": {"factor": 4.0}}',
        "--served-model-name=qwen 27b",
        "--host",
        "127.0.0.1",
        "--port",
        "30000",
    ]
    assert "--enable-metrics" not in argv  # the string 'false' from -e is false


@pytest.mark.skipif(_systemd.ENV_GENERATOR is None, reason="systemd's environment.d generator not installed")
def test_systemd_reads_back_exactly_the_env_meant(odd_unit: Path):
    env = _systemd.env_file(odd_unit / "sglang-qwen.env", dollar_names=("NOT_A_VAR", "ecret"))
    assert env["ODD"] == ODD_ENV["ODD"] and env["CUDA_HOME"] == "/usr/local/cuda"
    assert env["HF_TOKEN"] == 'hf_$ecret"`' and env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert env["HOME"] == "/var/lib/sglang"
    assert "\\u" not in (odd_unit / "sglang-qwen.env").read_text()  # UTF-8, not JSON escapes


def test_the_service_preflight_names_every_bad_value_at_once():
    hostile = {
        "sglang_extra_flags": ["--log-level info" + INJECT],
        "sglang_service_flag_overrides": {"context-length": "8192" + INJECT},
        "sglang_service_cuda_visible_devices": "0" + INJECT,
        "sglang_service_unit_name": "sglang-qwen\n",
        "sglang_service_port": -5,
        "sglang_service_user": "root",
        "sglang_extra_env": {"X": "1\nLD_PRELOAD=/tmp/evil.so"},
        "sglang_model_path": "/srv/m\n--x",
    }
    result = playbook(
        PLAYBOOKS / "preflight.yml", "-e", f"ddtree_runtime_source_dir={REPO}", "-e", json.dumps(hostile)
    )
    assert result.returncode != 0
    said = result.stdout
    assert "Invalid service variables for localhost (nothing on any host was changed)" in said
    for name in (
        "sglang_service_extra_flags[0]",
        "sglang_service_flag_overrides.context-length",
        "sglang_service_cuda_visible_devices",
        "sglang_service_unit_name",
        "sglang_service_port",
        "sglang_service_user",
        "sglang_service_extra_env.X",
        "sglang_service_model_path",
    ):
        assert f"{name}: " in said, name
    assert "TASK [Runtime preflight]" not in said


def test_the_argument_spec_refuses_a_bool_typo_before_the_check():
    result = playbook(
        PLAYBOOKS / "preflight.yml",
        "-e",
        f"ddtree_runtime_source_dir={REPO}",
        "-e",
        "sglang_service_enable_metrics=flase",
    )
    assert result.returncode != 0
    assert "The value 'flase' is not a valid boolean" in result.stdout


def test_the_service_preflight_refuses_an_account_the_install_would_rewrite():
    result = playbook(
        PLAYBOOKS / "preflight.yml",
        "-e",
        f"ddtree_runtime_source_dir={REPO}",
        "-e",
        "sglang_service_user=daemon",
    )
    assert result.returncode != 0
    assert "sglang_service_user: 'daemon' already exists on the host with home" in " ".join(
        result.stdout.split()
    )


def _canary_preflight(tmp_path: Path, state: dict[str, Any], **extra: Any):
    (tmp_path / "sglang-qwen.json").write_text(json.dumps(state))
    return playbook(
        PLAYBOOKS / "canary_preflight.yml",
        "-e",
        json.dumps({"sglang_canary_state_dir": str(tmp_path), **extra}),
    )


def test_the_canary_preflight_names_every_bad_value_and_distrusts_a_tampered_state(tmp_path):
    good = {
        "release": "0123456789abcdef",
        "previous_release": None,
        "port": 30000,
        "profile": "balanced",
        "release_dir": "/opt/ddtree/releases/0123456789abcdef",
    }
    result = _canary_preflight(tmp_path, good)
    assert result.returncode == 0, result.stdout[-3000:]
    hostile = {
        "sglang_canary_live_unit_name": "sglang-qwen; touch /tmp/pwned",
        "sglang_canary_shadow_unit_name": "../../../../etc",
        "sglang_canary_rounds": 0,
        "canary_shadow_extra_flags": ["--mem-fraction-static 0.5" + INJECT],
    }
    said = " ".join(_canary_preflight(tmp_path, good, **hostile).stdout.split())
    assert "Invalid canary variables for localhost (nothing on any host was changed)" in said
    for name in (
        "sglang_canary_live_unit_name",
        "sglang_canary_shadow_unit_name",
        "sglang_canary_rounds",
        "sglang_canary_shadow_extra_flags[0]",
    ):
        assert f"{name}: " in said, name
    tampered = {
        **good,
        "release_dir": "/opt/ddtree/releases/../../../etc",
        "previous_release": "../../../etc",
    }
    said = " ".join(_canary_preflight(tmp_path, tampered).stdout.split())
    assert f"The live deployed state {tmp_path}/sglang-qwen.json on localhost cannot be trusted" in said
    assert "release_dir: '/opt/ddtree/releases/../../../etc' is not a normalised path" in said
    assert "previous_release: '../../../etc' is not a release id" in said


def test_the_exporter_preflight_distrusts_a_tampered_state_and_names_bad_values(tmp_path):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "sglang-qwen.json").write_text(json.dumps({"release_dir": "/tmp/x; reboot"}))
    extra = {
        "ddtree_exporter_state_dir": str(tmp_path),
        "ddtree_exporter_release_dir": "",
        "out_dir": str(tmp_path),
    }
    said = " ".join(playbook(PLAYBOOKS / "render_exporter.yml", "-e", json.dumps(extra)).stdout.split())
    assert "cannot be trusted: sglang-qwen.json release_dir: '/tmp/x; reboot' holds characters" in said
    hostile = {
        **extra,
        "ddtree_exporter_probe_units": [{"unit": "sglang-qwen" + INJECT, "port": "1\nX=1"}],
        "ddtree_exporter_probe_interval": "15min\nExecStartPre=+/bin/sh",
        "ddtree_exporter_user": "root",
    }
    said = " ".join(playbook(PLAYBOOKS / "render_exporter.yml", "-e", json.dumps(hostile)).stdout.split())
    assert "Invalid exporter variables for localhost (nothing on any host was changed)" in said
    for name in (
        "ddtree_exporter_probe_units[0].unit",
        "ddtree_exporter_probe_units[0].port",
        "ddtree_exporter_probe_interval",
        "ddtree_exporter_user",
    ):
        assert f"{name}: " in said, name
