"""The roles' preflight checks: every value of a role's inputs dict (its ``vars/main.yml``) that reaches a
unit, an env file, a flag list, a path or a command, checked on the controller before any host changes.

A refusal names the variable, shows the value and says the rule. The router's own checks are in
``router_flags``.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from typing import Any

from .launch_flags import launch_problems, profile_flags
from .values import (
    UNIT_NAME,
    abs_path,
    account,
    as_int,
    clients,
    collect,
    env_name,
    env_value,
    integer,
    ip_address,
    listen_address,
    number,
    one_line,
    port,
    problem,
    release_id,
    strict_bool,
    string_list,
    timespan,
    unit_name,
    visible_devices,
)

_DIRECTIVE = re.compile(r"[A-Z][A-Za-z]{1,63}")
_DEVICE_ALLOW = re.compile(r"(char-[a-z0-9_-]+|block-[a-z0-9_-]+|/dev/[A-Za-z0-9/_.:-]+)( [rwm]{1,3})?")
_URL = re.compile(r"https?://[A-Za-z0-9.\[\]:_-]+(/[A-Za-z0-9._/-]*)?")
_REQUIREMENT = re.compile(r"[A-Za-z0-9._\[\],<>=!~+-]+")


def env_problems(name: str, env: Any, *, secret: bool = False) -> list[str]:
    if not isinstance(env, Mapping):
        return [problem(name, "(not shown)" if secret else env, "is not a mapping NAME -> value")]
    problems = []
    for key, value in env.items():
        problems += collect(env_name(f"{name} key", key),
                            env_value(f"{name}.{key}", value, secret=secret))
    return problems


def service_problems(v: Mapping[str, Any]) -> list[str]:
    """Every sglang_service value that reaches the unit, its env file, its flags or a path."""
    profile = v.get("profile_data") or {}
    problems = collect(
        unit_name("sglang_service_unit_name", v.get("unit_name")),
        None if isinstance(v.get("profile"), str) and UNIT_NAME.fullmatch(v["profile"]) else problem(
            "sglang_service_profile", v.get("profile"), "is not a profile name"),
        one_line("the profile's description", profile.get("description", ""), limit=200),
        port("sglang_service_port", v.get("port"), zero_means="the profile's port"),
        port("the profile's port", profile.get("port")),
        None if v.get("effective_port") is None or port("", v.get("port"), zero_means="-") else port(
            "the service port (the profile's)", v.get("effective_port")),
        abs_path("sglang_service_release_dir", v.get("release_dir")) if v.get("release_dir") else None,
        abs_path("sglang_service_model_path", v.get("model_path"), plain=False),
        abs_path("sglang_service_draft_model_path", v.get("draft_model_path"), plain=False),
        *[abs_path(f"sglang_service_{d}", v.get(d)) for d in
          ("unit_dir", "env_dir", "state_dir", "rollback_dir")],
        strict_bool("sglang_service_enable_metrics", v.get("enable_metrics")),
        strict_bool("sglang_service_plan", v.get("plan")),
        profile_flags("sglang_service_flag_overrides", v.get("flag_overrides")),
        profile_flags("the profile's flags", profile.get("flags")),
        launch_problems("sglang_service_extra_flags", v.get("extra_flags")),
        env_problems("sglang_service_engine_env", v.get("engine_env")),
        env_problems("sglang_service_extra_env", v.get("extra_env")),
        env_problems("sglang_service_secret_env", v.get("secret_env"), secret=True),
        visible_devices("sglang_service_cuda_visible_devices", v.get("cuda_visible_devices")),
        account("sglang_service_user", v.get("user")),
        account("sglang_service_group", v.get("group")),
        integer("sglang_service_ready_timeout", v.get("ready_timeout"), 1, 86400),
        integer("sglang_service_start_timeout", v.get("start_timeout"), 1, 86400),
        integer("sglang_service_stop_timeout", v.get("stop_timeout"), 1, 86400),
        integer("sglang_service_stable_s", v.get("stable_s"), 0, 86400),
        integer("sglang_service_restart_sec", v.get("restart_sec"), 0, 86400),
        integer("sglang_service_start_limit_interval", v.get("start_limit_interval"), 1, 10**6),
        integer("sglang_service_start_limit_burst", v.get("start_limit_burst"), 1, 1000),
        clients("sglang_service_allowed_clients", v.get("allowed_clients")),
        string_list("sglang_service_device_allow", v.get("device_allow")),
        string_list("sglang_service_sandbox_disable", v.get("sandbox_disable")),
    )
    for entry in v.get("device_allow") or []:
        if isinstance(entry, str) and not _DEVICE_ALLOW.fullmatch(entry):
            problems.append(problem("sglang_service_device_allow entry", entry,
                                    "is not a DeviceAllow= value: char-NAME, block-NAME or /dev/PATH, "
                                    "then r, w, m (e.g. 'char-nvidia rwm')"))
    sandbox = v.get("sandbox")
    if not isinstance(sandbox, Mapping):
        problems.append(problem("sglang_service_sandbox", sandbox, "is not a mapping Directive -> value"))
    else:
        for key, value in sandbox.items():
            if not isinstance(key, str) or not _DIRECTIVE.fullmatch(key):
                problems.append(problem("sglang_service_sandbox key", key, "is not a systemd directive name "
                                        "(e.g. ProtectSystem)"))
            elif bad := one_line(f"sglang_service_sandbox.{key}", value, limit=512):
                problems.append(bad)
    if not problems and as_int(v.get("start_timeout")) < as_int(v.get("ready_timeout")):  # type: ignore[operator]
        problems.append(problem("sglang_service_start_timeout", v.get("start_timeout"),
                                f"is below sglang_service_ready_timeout ({v.get('ready_timeout')}): systemd "
                                "would stop the start before the readiness wait ends"))
    return problems


def canary_problems(v: Mapping[str, Any]) -> list[str]:
    problems = collect(
        unit_name("sglang_canary_shadow_unit_name", v.get("shadow_unit_name")),
        unit_name("sglang_canary_live_unit_name", v.get("live_unit_name")),
        port("sglang_canary_shadow_port", v.get("shadow_port")),
        port("sglang_canary_live_port", v.get("live_port"), zero_means="the port live's state records"),
        integer("sglang_canary_rounds", v.get("rounds"), 1, 100),
        integer("sglang_canary_max_new_tokens", v.get("max_new_tokens"), 1, 4096),
        number("sglang_canary_min_accept_ratio", v.get("min_accept_ratio"), 0, 1.5, low_open=True),
        number("sglang_canary_max_latency_ratio", v.get("max_latency_ratio"), 0, 1000, low_open=True),
        number("sglang_canary_latency_slack_s", v.get("latency_slack_s"), 0, 3600),
        integer("sglang_canary_ready_timeout", v.get("ready_timeout"), 1, 86400),
        integer("sglang_canary_traffic_s", v.get("traffic_s"), 0, 86400),
        integer("sglang_canary_traffic_requests", v.get("traffic_requests"), 1, 10**6),
        number("sglang_canary_traffic_max_error_rate_increase",
               v.get("traffic_max_error_rate_increase"), 0, 1),
        strict_bool("sglang_canary_require_equal_tokens", v.get("require_equal_tokens")),
        string_list("sglang_canary_prompts", v.get("prompts"), limit=64),
        launch_problems("sglang_canary_shadow_extra_flags", v.get("shadow_extra_flags")),
        env_problems("sglang_canary_shadow_extra_env", v.get("shadow_extra_env")),
        visible_devices("sglang_canary_shadow_cuda_visible_devices", v.get("shadow_cuda_visible_devices")),
        *[abs_path(f"sglang_canary_{d}", v.get(d)) for d in
          ("report_dir", "unit_dir", "env_dir", "state_dir", "rollback_dir")],
    )
    if v.get("release_dir"):
        problems += collect(abs_path("sglang_canary_release_dir", v.get("release_dir")))
    if not problems and v.get("shadow_unit_name") == v.get("live_unit_name"):
        problems.append(problem("sglang_canary_shadow_unit_name", v.get("shadow_unit_name"),
                                "is the live unit's name: the shadow runs beside live, under its own name"))
    return problems


def recorded_state_problems(name: str, state: Any, releases_dir: str) -> list[str]:
    """A deployed-state file (<unit>.json) read back from a host before its values steer paths."""
    if not isinstance(state, Mapping):
        return [problem(name, state, "is not a JSON object (the service role writes one)")]
    problems = []
    for key in ("release", "previous_release"):
        if state.get(key) is not None:
            problems += collect(release_id(f"{name} {key}", state.get(key)))
    release_dir = state.get("release_dir")
    if release_dir is not None:
        bad = abs_path(f"{name} release_dir", release_dir)
        if bad is None and posixpath.dirname(release_dir) != releases_dir:
            bad = problem(f"{name} release_dir", release_dir, f"is not a release under {releases_dir}")
        problems += collect(bad)
    if state.get("port") is not None:
        problems += collect(port(f"{name} port", state.get("port")))
    if state.get("profile") is not None and not (isinstance(state["profile"], str)
                                                  and UNIT_NAME.fullmatch(state["profile"])):
        problems.append(problem(f"{name} profile", state.get("profile"), "is not a profile name"))
    return problems


def exporter_problems(v: Mapping[str, Any]) -> list[str]:
    problems = collect(
        port("ddtree_exporter_port", v.get("port")),
        listen_address("ddtree_exporter_listen_address", v.get("listen_address")),
        clients("ddtree_exporter_allowed_clients", v.get("allowed_clients")),
        abs_path("ddtree_exporter_state_dir", v.get("state_dir")),
        abs_path("ddtree_exporter_unit_dir", v.get("unit_dir")),
        abs_path("ddtree_exporter_probe_env_dir", v.get("probe_env_dir")),
        abs_path("ddtree_exporter_release_dir", v.get("release_dir")) if v.get("release_dir") else None,
        unit_name("ddtree_exporter_state_unit", v.get("state_unit")),
        account("ddtree_exporter_user", v.get("user")),
        account("ddtree_exporter_probe_user", v.get("probe_user")),
        timespan("ddtree_exporter_probe_interval", v.get("probe_interval")),
        number("ddtree_exporter_probe_min_accept_length", v.get("probe_min_accept_length"), 1.0, 1000),
        strict_bool("ddtree_exporter_probe_allow_lossless_unchecked",
                   v.get("probe_allow_lossless_unchecked", False)),
        integer("ddtree_exporter_probe_timeout", v.get("probe_timeout"), 1, 86400),
        integer("ddtree_exporter_probe_request_timeout", v.get("probe_request_timeout"), 1, 86400),
    )
    units = v.get("probe_units")
    if not isinstance(units, list) or len(units) > 64:
        problems.append(problem("ddtree_exporter_probe_units", units, "is not a list of {unit, port}"))
    else:
        for i, entry in enumerate(units):
            if not isinstance(entry, Mapping):
                problems.append(problem(f"ddtree_exporter_probe_units[{i}]", entry, "is not {unit, port}"))
                continue
            problems += collect(unit_name(f"ddtree_exporter_probe_units[{i}].unit", entry.get("unit")),
                                port(f"ddtree_exporter_probe_units[{i}].port", entry.get("port")))
    if not problems and v.get("user") == v.get("probe_user"):
        problems.append(problem("ddtree_exporter_probe_user", v.get("probe_user"),
                                "is the exporter's user: the probe runs as a user of its own"))
    return problems


def probe_problems(v: Mapping[str, Any]) -> list[str]:
    url = v.get("url")
    bad_url = None
    if not isinstance(url, str) or not _URL.fullmatch(url):
        bad_url = problem("ddtree_probe_url", url, "is not an http(s) URL to the server (e.g. "
                          "http://127.0.0.1:30000)")
    problems = collect(
        bad_url,
        unit_name("ddtree_probe_unit_name", v.get("unit_name")),
        abs_path("ddtree_probe_model_path", v.get("model_path"), plain=False),
        abs_path("ddtree_probe_draft_model_path", v.get("draft_model_path"), plain=False),
        abs_path("ddtree_probe_report_dir", v.get("report_dir")),
        number("ddtree_probe_min_accept_length", v.get("min_accept_length"), 1.0, 1000),
        strict_bool("ddtree_probe_allow_lossless_unchecked", v.get("allow_lossless_unchecked", False)),
        integer("ddtree_probe_timeout", v.get("timeout"), 1, 86400),
    )
    since = v.get("journal_since")
    if since not in (None, "") and integer("ddtree_probe_journal_since", since, 0, 10**11):
        problems.append(problem("ddtree_probe_journal_since", since, "is not epoch seconds (or empty)"))
    expect = v.get("expect")
    if not isinstance(expect, Mapping):
        problems.append(problem("ddtree_probe_expect", expect, "is not a mapping"))
    else:
        for key, value in expect.items():
            problems += collect(None if isinstance(key, str) and re.fullmatch(r"[a-z0-9_]{1,64}", key) else
                                problem("ddtree_probe_expect key", key, "is not a server_info field name"),
                                one_line(f"ddtree_probe_expect.{key}", value, limit=256))
    return problems


def runtime_problems(v: Mapping[str, Any]) -> list[str]:
    problems = collect(
        *[abs_path(f"ddtree_runtime_{d}", v.get(d)) for d in ("root", "python", "wheelhouse", "models_dir")],
        integer("ddtree_runtime_keep_releases", v.get("keep_releases"), 1, 100),
        strict_bool("ddtree_runtime_plugin_check", v.get("plugin_check")),
        strict_bool("ddtree_runtime_lab_cpu_compat", v.get("lab_cpu_compat")),
        strict_bool("ddtree_runtime_make_lab_models", v.get("make_lab_models")),
        string_list("ddtree_runtime_pip_index_args", v.get("pip_index_args")),
        string_list("ddtree_runtime_packages", v.get("packages")),
        string_list("ddtree_runtime_nodeps_packages", v.get("nodeps_packages")),
        string_list("ddtree_runtime_reference_paths", v.get("reference_paths")),
    )
    for key in ("packages", "nodeps_packages"):
        for item in v.get(key) or []:
            if isinstance(item, str) and (item.startswith("-") or not _REQUIREMENT.fullmatch(item)):
                problems.append(problem(f"ddtree_runtime_{key} entry", item, "is not a pinned requirement "
                                        "(name==version, no spaces, not a pip option)"))
    for path in v.get("reference_paths") or []:
        problems += collect(abs_path("ddtree_runtime_reference_paths entry", path))
    return problems


def rotation_problems(v: Mapping[str, Any]) -> list[str]:
    """The sglang_rotation values that reach a router's control API, a URL or a wait."""
    return collect(
        strict_bool("sglang_rotation_enabled", v.get("enabled")),
        strict_bool("sglang_rotation_allow_single_host_downtime", v.get("allow_single_host_downtime")),
        ip_address("sglang_rotation_worker_address", v.get("worker_address")),
        ip_address("sglang_rotation_local_address", v.get("local_address")),
        port("sglang_rotation_port", v.get("port")),
        port("sglang_rotation_shadow_port", v.get("shadow_port")),
        unit_name("sglang_rotation_unit", v.get("unit")),
        abs_path("sglang_rotation_state_dir", v.get("state_dir")),
        integer("sglang_rotation_drain_timeout", v.get("drain_timeout"), 0, 86400),
        integer("sglang_rotation_join_timeout", v.get("join_timeout"), 1, 86400),
        integer("sglang_rotation_api_timeout", v.get("api_timeout"), 1, 3600),
        string_list("sglang_rotation_routers", v.get("routers")),
    )
