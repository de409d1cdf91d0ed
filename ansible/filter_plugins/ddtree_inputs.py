"""Filters over ddtree_runtime/inputs/: the roles' input checks and systemd quoting.

The folder is loaded as a package by its file path from the checkout the play runs from (stdlib and the
PyYAML ansible-core brings, its modules importing one another relatively), so the controller needs nothing
of ours installed for the preflight to run; the checks read the roles' argument specs from that checkout.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleFilterError

_SOURCE = Path(__file__).resolve().parents[2] / "ddtree_runtime" / "inputs"
# A private package name: the checkout's rules, whatever ddtree_runtime the controller may have installed.
_PACKAGE = "ddtree_deploy_inputs"


def _load(module: str) -> Any:
    if _PACKAGE not in sys.modules:
        spec = importlib.util.spec_from_file_location(_PACKAGE, _SOURCE / "__init__.py",
                                                      submodule_search_locations=[str(_SOURCE)])
        package = importlib.util.module_from_spec(spec)
        sys.modules[_PACKAGE] = package
        spec.loader.exec_module(package)
    return importlib.import_module(f"{_PACKAGE}.{module}")


_values = _load("values")
_flags = _load("launch_flags")
_quote = _load("systemd_quoting")
_checks = _load("role_checks")
_command = _load("service_command")
_router = _load("router_flags")
_answers = _load("router_answers")


def _quoting(func: Any) -> Any:
    """A quoting filter whose refusal fails the task with the rule, not a Python traceback."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except _values.InputError as exc:
            raise AnsibleFilterError(str(exc)) from None

    return wrapped


def _plain(value: Any) -> Any:
    """Ansible's lazy containers as plain dicts and lists (the rules check types)."""
    if isinstance(value, dict):
        return {str(k) if not isinstance(k, str) else k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, str):
        return str(value)
    return value


def _existing_account(passwd_line: Any, name: str, value: str, home: str, shell: str) -> list[str]:
    found = _values.existing_account(name, value, str(passwd_line or ""), home=home, shell=shell)
    return [found] if found else []


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "ddtree_service_problems": lambda v: _checks.service_problems(_plain(v)),
            "ddtree_service_argv": _quoting(lambda v: _command.service_argv(_plain(v))),
            "ddtree_service_env": _quoting(lambda v: _command.service_env(_plain(v))),
            "ddtree_canary_problems": lambda v: _checks.canary_problems(_plain(v)),
            "ddtree_exporter_problems": lambda v: _checks.exporter_problems(_plain(v)),
            "ddtree_probe_problems": lambda v: _checks.probe_problems(_plain(v)),
            "ddtree_runtime_problems": lambda v: _checks.runtime_problems(_plain(v)),
            "ddtree_router_problems": lambda v: _router.router_problems(_plain(v)),
            "ddtree_rotation_problems": lambda v: _checks.rotation_problems(_plain(v)),
            "ddtree_router_argv": _quoting(lambda v: _router.router_argv(_plain(v))),
            # What a router answered: checked, in one URL spelling (a refusal fails the task, one line).
            "ddtree_worker_url": _quoting(lambda url: _answers.worker_url(_plain(url))),
            "ddtree_router_lists": lambda answer, urls, healthy=False: _answers.router_lists(
                _plain(answer), _plain(urls), healthy=bool(healthy)),
            "ddtree_router_rotation_urls": _quoting(lambda answer, router: _answers.router_rotation_urls(
                _plain(answer), str(router))),
            "ddtree_state_problems": lambda state, name, releases_dir: _checks.recorded_state_problems(
                name, _plain(state), str(releases_dir)),
            "ddtree_account_problems": _existing_account,
            "ddtree_split_flags": _quoting(lambda items, name="sglang_extra_flags": _flags.split_launch_flags(
                _plain(items), name)),
            "ddtree_exec_line": _quoting(lambda argv: _quote.exec_line(_plain(argv))),
            "ddtree_exec_words": _quoting(lambda argv: _quote.exec_words(_plain(argv))),
            "ddtree_systemd_word": _quoting(_quote.systemd_word),
            "ddtree_env_value": _quoting(_quote.env_file_value),
            "ddtree_unit_value": _quoting(lambda value, name="a unit value": _quote.unit_value(name, value)),
        }
