"""The router's unit (sglang-router, pinned): its ExecStart words, the pinned parser's options (an
extra flag is read as argparse reads it, prefixes too) and the router role's input checks."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .argspec import Range, Rule, option_problems
from .launch_flags import launch_problems, split_launch_flags
from .values import (
    InputError,
    account,
    as_int,
    clients,
    collect,
    ip_address,
    listen_address,
    port,
    problem,
)

_ROUTER_VERSION = re.compile(r"\d{1,4}\.\d{1,4}\.\d{1,4}")
# 16+ characters the router's id:name:role:key list and an HTTP bearer header both carry as they are.
_CONTROL_KEY = re.compile(r"[A-Za-z0-9_.~+/=-]{16,256}")
# Every long option of the pinned router's parser (sglang_router.launch_router.parse_router_args, an
# argparse parser with allow_abbrev: any unambiguous prefix of one of these is that option).
# tests/unit/test_router_role.py reads the installed router's own parser and keeps this equal.
_ROUTER_0_3_2_OPTIONS = """
        --host --port --worker-urls --policy --prefill-policy --decode-policy --cache-threshold
        --balance-abs-threshold --balance-rel-threshold --bucket-adjust-interval-secs --eviction-interval-secs
        --max-tree-size --max-idle-secs --assignment-mode --max-payload-size --dp-aware --enable-igw --mini-lb
        --pd-disaggregation --prefill --decode --worker-startup-timeout-secs --worker-startup-check-interval
        --log-dir --log-level --service-discovery --selector --service-discovery-port
        --service-discovery-namespace --prefill-selector --decode-selector --prometheus-port --prometheus-host
        --prometheus-duration-buckets --request-id-headers --request-timeout-secs --shutdown-grace-period-secs
        --cors-allowed-origins --max-concurrent-requests --queue-size --queue-timeout-secs
        --rate-limit-tokens-per-second --retry-max-retries --retry-initial-backoff-ms --retry-max-backoff-ms
        --retry-backoff-multiplier --retry-jitter-factor --disable-retries --cb-failure-threshold
        --cb-success-threshold --cb-timeout-duration-secs --cb-window-duration-secs --disable-circuit-breaker
        --health-failure-threshold --health-success-threshold --health-check-timeout-secs
        --health-check-interval-secs --health-check-endpoint --disable-health-check --model-path
        --tokenizer-path --chat-template --tokenizer-cache-enable-l0 --tokenizer-cache-l0-max-entries
        --tokenizer-cache-enable-l1 --tokenizer-cache-l1-max-memory --reasoning-parser --tool-call-parser
        --mcp-config-path --backend --history-backend --oracle-wallet-path --oracle-tns-alias
        --oracle-connect-descriptor --oracle-username --oracle-password --oracle-pool-min --oracle-pool-max
        --oracle-pool-timeout-secs --postgres-db-url --postgres-pool-max --redis-url --redis-pool-max
        --redis-retention-days --client-cert-path --client-key-path --ca-cert-paths --tls-cert-path
        --tls-key-path --enable-trace --otlp-traces-endpoint --api-key --control-plane-api-keys
        --control-plane-audit-enabled --jwt-issuer --jwt-audience --jwt-jwks-uri --jwt-role-mapping
        --help"""
ROUTER_OPTIONS: dict[str, frozenset[str]] = {"0.3.2": frozenset(_ROUTER_0_3_2_OPTIONS.split())}
# What extra flags may never set, besides every flag router_argv renders: the launcher's own (the
# worker list and the control key, from the unit's environment), secrets (a unit and a command line are
# readable by every local user), and what turns off what the rotation relies on or exits the router.
ROUTER_LAUNCHER_FLAGS = ("--worker-urls", "--control-plane-api-keys")
ROUTER_SECRET_FLAGS = ("--api-key", "--oracle-password", "--postgres-db-url", "--redis-url")
ROUTER_MODE_FLAGS = ("--help", "--disable-health-check", "--mini-lb", "--pd-disaggregation",
                     "--service-discovery", "--enable-igw", "--tls-cert-path", "--tls-key-path",
                     "--health-check-endpoint")


def resolve_router_option(word: str, version: str) -> tuple[str | None, str | None]:
    """(the option the pinned router's argparse reads `word` as, None) or (None, why it reads none):
    an exact name, else the one option it is a prefix of; `--name=value` counts by its name."""
    options = ROUTER_OPTIONS.get(version)
    if options is None:
        known = ", ".join(sorted(ROUTER_OPTIONS))
        return None, (f"cannot be checked: the flag table knows sglang-router {known} only, not "
                      f"{version} (add its options to ddtree_runtime/inputs/router_flags.ROUTER_OPTIONS)")
    name = word.partition("=")[0]
    if name in options:
        return name, None
    matches = sorted(o for o in options if o.startswith(name))
    if len(matches) == 1:
        return matches[0], None
    if matches:
        shown = ", ".join(matches[:6])
        return None, f"is ambiguous to sglang-router {version} ({shown}...): it would not start"
    return None, f"is not an option of sglang-router {version}: it would not start"


# The role installs roles/sglang_router/files/ddtree-router-launch.py under sglang_router_root.
ROUTER_LAUNCHER = "ddtree-router-launch.py"


def router_argv(v: Mapping[str, Any]) -> list[str]:
    """The router unit's ExecStart words (the launcher, then every flag the role sets). The worker list
    and the control key are not here: the launcher reads them from the unit's environment."""
    venv = f"{v['root']}/{v['version']}"
    argv = [f"{venv}/bin/python", "-I", f"{v['root']}/{ROUTER_LAUNCHER}",
            "--host", str(v["listen_address"]), "--port", str(v["port"]), "--policy", str(v["policy"]),
            "--prometheus-host", str(v["metrics_listen_address"]),
            "--prometheus-port", str(v["metrics_port"]),
            "--health-check-interval-secs", str(v["health_check_interval_s"]),
            "--health-failure-threshold", str(v["health_failure_threshold"]),
            "--request-timeout-secs", str(v["request_timeout_s"]),
            "--shutdown-grace-period-secs", str(v["shutdown_grace_s"]),
            "--worker-startup-timeout-secs", str(v["worker_startup_timeout_s"])]
    return argv + split_launch_flags(v.get("extra_flags") or [], "sglang_router_extra_flags")


def router_flag_problems(v: Mapping[str, Any]) -> list[str]:
    """Extra router flags read as the pinned router's parser reads them (prefixes too), refused when one
    names a flag the role's unit sets, a secret, or a mode the rotation cannot work with."""
    items = v.get("extra_flags")
    if not isinstance(items, list) or launch_problems("sglang_router_extra_flags", items):
        return []  # said by launch_problems
    version = str(v.get("version"))
    try:
        owned = {w for w in router_argv({**v, "extra_flags": []}) if w.startswith("--")}
    except (KeyError, InputError):
        owned = set()
    owned |= set(ROUTER_LAUNCHER_FLAGS)
    problems = []
    # Only the flag's name is shown: its value may be a secret.
    for i, item in enumerate(items):
        text = str(item)
        if not text.startswith("--"):
            continue  # a value of its own item
        name = text.partition(" ")[0].partition("=")[0]
        where = f"sglang_router_extra_flags[{i}]"
        option, why = resolve_router_option(name, version)
        if option is None:
            problems.append(problem(where, name, str(why)))
        elif option in ROUTER_SECRET_FLAGS:
            problems.append(problem(where, name, f"is {option}, a secret: the unit and the router's command "
                                    "line are readable by every local user, so it is not supported here"))
        elif option in owned:
            owned_list = ", ".join(sorted(owned))
            problems.append(problem(where, name, f"is read as {option} by sglang-router {version}, which "
                                    f"the role sets itself: {owned_list} may not be given here"))
        elif option in ROUTER_MODE_FLAGS:
            problems.append(problem(where, name, f"is read as {option}: the role and the rotation need the "
                                    "router's plain-HTTP control API and its health checks as they are"))
    return problems


def _router_version(name: str, value: Any) -> str | None:
    if isinstance(value, str) and _ROUTER_VERSION.fullmatch(value):
        return None
    return problem(name, value, "is not a release like 0.3.2")


def _control_key(name: str, key: Any) -> str | None:
    if not isinstance(key, str) or (key != "" and not _CONTROL_KEY.fullmatch(key)):
        return problem(name, key, "is not 16-256 characters of A-Z a-z 0-9 and -_.~+/= (or empty on a "
                       "loopback router)", secret=True)
    return None


ROUTER: dict[str, Rule] = {
    "sglang_router_version": _router_version,
    "sglang_router_listen_address": listen_address,
    "sglang_router_metrics_listen_address": listen_address,
    "sglang_router_port": port,
    "sglang_router_metrics_port": port,
    "sglang_router_allowed_clients": clients,
    "sglang_router_control_key": _control_key,
    "sglang_router_health_check_interval_s": Range(1, 3600),
    "sglang_router_health_failure_threshold": Range(1, 1000),
    "sglang_router_request_timeout_s": Range(1, 86400),
    "sglang_router_shutdown_grace_s": Range(0, 86400),
    "sglang_router_worker_startup_timeout_s": Range(1, 86400),
    "sglang_router_extra_flags": launch_problems,
    "sglang_router_user": account,
}
# Inputs the role derives rather than takes (no spec option): checked below.
ROUTER_DERIVED = ("worker_addresses",)


def router_problems(v: Mapping[str, Any]) -> list[str]:
    """Every sglang_router value that reaches its unit, its env file, its venv's path or pip."""
    problems = option_problems("sglang_router", v, ROUTER)
    if not problems and as_int(v.get("port")) == as_int(v.get("metrics_port")):
        problems.append(problem("sglang_router_metrics_port", v.get("metrics_port"),
                                "is the router's port: the metrics listen on a port of their own"))
    problems += router_flag_problems(v)
    addresses = v.get("worker_addresses")
    for i, address in enumerate(addresses if isinstance(addresses, list) else [addresses]):
        problems += collect(ip_address(f"sglang_router_workers[{i}]'s address", address))
    return problems
