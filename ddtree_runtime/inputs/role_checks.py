"""The roles' preflight checks: every value of a role's inputs dict (its ``vars/main.yml``) that reaches a
unit, an env file, a flag list, a path or a command, checked on the controller before any host changes.

Names, types and choices come from each role's ``meta/argument_specs.yml`` (``argspec``); what is here is
what a spec cannot say: a number's range, a string's shape, the values the role derives, and rules across
variables. A refusal names the variable, shows the value and says the rule. The router's own checks are in
``router_flags``.
"""

from __future__ import annotations

import functools
import posixpath
import re
from collections.abc import Mapping
from typing import Any

from .argspec import Range, Rule, option_problems
from .decoder_flags import BUDGET, TOPK_CAP, decoder_problems, extra_budget
from .launch_flags import launch_problems, profile_flags, split_launch_flags
from .values import (
    UNIT_NAME,
    InputError,
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
    one_line,
    port,
    problem,
    release_id,
    string_list,
    timespan,
    unit_name,
    visible_devices,
)

_DIRECTIVE = re.compile(r"[A-Z][A-Za-z]{1,63}")
_DEVICE_ALLOW = re.compile(r"(char-[a-z0-9_-]+|block-[a-z0-9_-]+|/dev/[A-Za-z0-9/_.:-]+)( [rwm]{1,3})?")
_URL = re.compile(r"https?://[A-Za-z0-9.\[\]:_-]+(/[A-Za-z0-9._/-]*)?")
_REQUIREMENT = re.compile(r"[A-Za-z0-9._\[\],<>=!~+-]+")
_SECONDS = Range(1, 86400)


def env_problems(name: str, env: Any, *, secret: bool = False) -> list[str]:
    if not isinstance(env, Mapping):
        return [problem(name, "(not shown)" if secret else env, "is not a mapping NAME -> value")]
    problems = []
    for key, value in env.items():
        problems += collect(env_name(f"{name} key", key),
                            env_value(f"{name}.{key}", value, secret=secret))
    return problems


def _optional_path(name: str, value: Any) -> str | None:
    """A release directory the play may leave empty (the role finds it then)."""
    return abs_path(name, value) if value else None


# Model directories are quoted where they go, so they may hold spaces (other paths may not).
_model_path = functools.partial(abs_path, plain=False)


def _secret_env(name: str, value: Any) -> list[str]:
    return env_problems(name, value, secret=True)


def _requirements(name: str, value: Any) -> list[str]:
    """Pinned pip requirements, never a pip option."""
    problems = collect(string_list(name, value))
    for item in value if isinstance(value, list) else []:
        if isinstance(item, str) and (item.startswith("-") or not _REQUIREMENT.fullmatch(item)):
            problems.append(problem(f"{name} entry", item, "is not a pinned requirement "
                                    "(name==version, no spaces, not a pip option)"))
    return problems


def _device_allow(name: str, value: Any) -> list[str]:
    problems = collect(string_list(name, value))
    for entry in value or []:
        if isinstance(entry, str) and not _DEVICE_ALLOW.fullmatch(entry):
            problems.append(problem(f"{name} entry", entry,
                                    "is not a DeviceAllow= value: char-NAME, block-NAME or /dev/PATH, "
                                    "then r, w, m (e.g. 'char-nvidia rwm')"))
    return problems


def _sandbox(name: str, sandbox: Any) -> list[str]:
    if not isinstance(sandbox, Mapping):
        return [problem(name, sandbox, "is not a mapping Directive -> value")]
    problems = []
    for key, value in sandbox.items():
        if not isinstance(key, str) or not _DIRECTIVE.fullmatch(key):
            problems.append(problem(f"{name} key", key, "is not a systemd directive name "
                                    "(e.g. ProtectSystem)"))
        elif bad := one_line(f"{name}.{key}", value, limit=512):
            problems.append(bad)
    return problems


SERVICE: dict[str, Rule] = {
    "sglang_service_unit_name": unit_name,
    "sglang_service_port": functools.partial(port, zero_means="the profile's port"),
    "sglang_service_release_dir": _optional_path,
    "sglang_service_model_path": _model_path,
    "sglang_service_draft_model_path": _model_path,
    "sglang_service_flag_overrides": profile_flags,
    "sglang_service_extra_flags": launch_problems,
    "sglang_service_engine_env": env_problems,
    "sglang_service_extra_env": env_problems,
    "sglang_service_secret_env": _secret_env,
    "sglang_service_cuda_visible_devices": visible_devices,
    "sglang_service_user": account,
    "sglang_service_group": account,
    "sglang_service_ready_timeout": _SECONDS,
    "sglang_service_start_timeout": _SECONDS,
    "sglang_service_stop_timeout": _SECONDS,
    "sglang_service_stable_s": Range(0, 86400),
    "sglang_service_restart_sec": Range(0, 86400),
    "sglang_service_start_limit_interval": Range(1, 10**6),
    "sglang_service_start_limit_burst": Range(1, 1000),
    "sglang_service_allowed_clients": clients,
    "sglang_service_device_allow": _device_allow,
    "sglang_service_sandbox": _sandbox,
}
# Inputs the role derives rather than takes (no spec option): checked below.
SERVICE_DERIVED = ("profile_data", "effective_port")


def _decoder_problems(v: Mapping[str, Any], flags: Any) -> list[str]:
    """The budget and top-K cap the unit will start with (the profile's, a host's overrides over them, a
    budget among the extra flags last), by the decoder settings' rule; named after where each came from."""
    if not isinstance(flags, Mapping):
        return []
    overrides = v.get("flag_overrides") if isinstance(v.get("flag_overrides"), Mapping) else {}
    named = {BUDGET, TOPK_CAP} & set(overrides)
    found = decoder_problems("sglang_service_flag_overrides" if named else "the profile's flags", flags)
    try:
        extra = extra_budget(split_launch_flags(v.get("extra_flags") or [], "sglang_service_extra_flags"))
    except InputError:
        return found  # launch_problems names it
    if extra is not None:
        found += decoder_problems("sglang_service_extra_flags", {**flags, BUDGET: extra})
    return found


def service_problems(v: Mapping[str, Any]) -> list[str]:
    """Every sglang_service value that reaches the unit, its env file, its flags or a path."""
    profile = v.get("profile_data") or {}
    problems = option_problems("sglang_service", v, SERVICE) + collect(
        one_line("the profile's description", profile.get("description", ""), limit=200),
        port("the profile's port", profile.get("port")),
        None if v.get("effective_port") is None or port("", v.get("port"), zero_means="-") else port(
            "the service port (the profile's)", v.get("effective_port")),
        profile_flags("the profile's flags", profile.get("flags")),
    )
    problems += _decoder_problems(v, profile.get("flags"))
    if not problems and as_int(v.get("start_timeout")) < as_int(v.get("ready_timeout")):  # type: ignore[operator]
        problems.append(problem("sglang_service_start_timeout", v.get("start_timeout"),
                                f"is below sglang_service_ready_timeout ({v.get('ready_timeout')}): systemd "
                                "would stop the start before the readiness wait ends"))
    return problems


CANARY: dict[str, Rule] = {
    "sglang_canary_shadow_unit_name": unit_name,
    "sglang_canary_live_unit_name": unit_name,
    "sglang_canary_shadow_port": port,
    "sglang_canary_live_port": functools.partial(port, zero_means="the port live's state records"),
    "sglang_canary_rounds": Range(1, 100),
    "sglang_canary_max_new_tokens": Range(1, 4096),
    "sglang_canary_min_accept_ratio": Range(0, 1.5, low_open=True),
    "sglang_canary_max_latency_ratio": Range(0, 1000, low_open=True),
    "sglang_canary_latency_slack_s": Range(0, 3600),
    "sglang_canary_ready_timeout": _SECONDS,
    "sglang_canary_traffic_s": Range(0, 86400),
    "sglang_canary_traffic_requests": Range(1, 10**6),
    "sglang_canary_traffic_max_error_rate_increase": Range(0, 1),
    "sglang_canary_prompts": functools.partial(string_list, limit=64),
    "sglang_canary_shadow_extra_flags": launch_problems,
    "sglang_canary_shadow_extra_env": env_problems,
    "sglang_canary_shadow_cuda_visible_devices": visible_devices,
    "sglang_canary_release_dir": _optional_path,
}


def canary_problems(v: Mapping[str, Any]) -> list[str]:
    problems = option_problems("sglang_canary", v, CANARY)
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


def _probe_units(name: str, units: Any) -> list[str]:
    if not isinstance(units, list) or len(units) > 64:
        return [problem(name, units, "is not a list of {unit, port}")]
    problems = []
    for i, entry in enumerate(units):
        if not isinstance(entry, Mapping):
            problems.append(problem(f"{name}[{i}]", entry, "is not {unit, port}"))
            continue
        problems += collect(unit_name(f"{name}[{i}].unit", entry.get("unit")),
                            port(f"{name}[{i}].port", entry.get("port")))
    return problems


EXPORTER: dict[str, Rule] = {
    "ddtree_exporter_port": port,
    "ddtree_exporter_listen_address": listen_address,
    "ddtree_exporter_allowed_clients": clients,
    "ddtree_exporter_release_dir": _optional_path,
    "ddtree_exporter_state_unit": unit_name,
    "ddtree_exporter_user": account,
    "ddtree_exporter_probe_user": account,
    "ddtree_exporter_probe_interval": timespan,
    "ddtree_exporter_probe_min_accept_length": Range(1.0, 1000),
    "ddtree_exporter_probe_timeout": _SECONDS,
    "ddtree_exporter_probe_request_timeout": _SECONDS,
    "ddtree_exporter_probe_units": _probe_units,
}


def exporter_problems(v: Mapping[str, Any]) -> list[str]:
    problems = option_problems("ddtree_exporter", v, EXPORTER)
    if not problems and v.get("user") == v.get("probe_user"):
        problems.append(problem("ddtree_exporter_probe_user", v.get("probe_user"),
                                "is the exporter's user: the probe runs as a user of its own"))
    return problems


def _probe_url(name: str, url: Any) -> str | None:
    if not isinstance(url, str) or not _URL.fullmatch(url):
        return problem(name, url, "is not an http(s) URL to the server (e.g. http://127.0.0.1:30000)")
    return None


def _journal_since(name: str, since: Any) -> str | None:
    if since not in (None, "") and integer(name, since, 0, 10**11):
        return problem(name, since, "is not epoch seconds (or empty)")
    return None


def _expect(name: str, expect: Any) -> list[str]:
    if not isinstance(expect, Mapping):
        return [problem(name, expect, "is not a mapping")]
    problems = []
    for key, value in expect.items():
        problems += collect(None if isinstance(key, str) and re.fullmatch(r"[a-z0-9_]{1,64}", key) else
                            problem(f"{name} key", key, "is not a server_info field name"),
                            one_line(f"{name}.{key}", value, limit=256))
    return problems


PROBE: dict[str, Rule] = {
    "ddtree_probe_url": _probe_url,
    "ddtree_probe_unit_name": unit_name,
    "ddtree_probe_model_path": _model_path,
    "ddtree_probe_draft_model_path": _model_path,
    "ddtree_probe_min_accept_length": Range(1.0, 1000),
    "ddtree_probe_timeout": _SECONDS,
    "ddtree_probe_journal_since": _journal_since,
    "ddtree_probe_expect": _expect,
}


def probe_problems(v: Mapping[str, Any]) -> list[str]:
    return option_problems("ddtree_probe", v, PROBE)


RUNTIME: dict[str, Rule] = {
    "ddtree_runtime_keep_releases": Range(1, 100),
    "ddtree_runtime_packages": _requirements,
    "ddtree_runtime_nodeps_packages": _requirements,
}


def runtime_problems(v: Mapping[str, Any]) -> list[str]:
    return option_problems("ddtree_runtime", v, RUNTIME)


ROTATION: dict[str, Rule] = {
    "sglang_rotation_worker_address": ip_address,
    "sglang_rotation_local_address": ip_address,
    "sglang_rotation_port": port,
    "sglang_rotation_shadow_port": port,
    "sglang_rotation_unit": unit_name,
    "sglang_rotation_drain_timeout": Range(0, 86400),
    "sglang_rotation_join_timeout": _SECONDS,
    "sglang_rotation_api_timeout": Range(1, 3600),
}


def rotation_problems(v: Mapping[str, Any]) -> list[str]:
    """The sglang_rotation values that reach a router's control API, a URL or a wait."""
    return option_problems("sglang_rotation", v, ROTATION)
