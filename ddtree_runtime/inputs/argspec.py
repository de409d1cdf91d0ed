"""The roles' argument specs (``roles/<role>/meta/argument_specs.yml``) as the one statement of each role
variable's name, type and choices: the input checks read them from there and add only what a spec cannot
say (a number's range, a string's shape, rules across variables).

Read from the checkout this file sits in, on the controller (PyYAML comes with ansible-core); the host
side never checks role inputs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .values import abs_path, collect, integer, number, problem, strict_bool, string_list

ROLES_DIR = Path(__file__).resolve().parents[2] / "roles"


@dataclass(frozen=True)
class Range:
    """A number's bounds: an argument spec has types, not ranges."""

    low: float
    high: float
    low_open: bool = False


# A content rule: a Range for an int or float option, else a check (variable name, value) -> problems.
Rule = Range | Callable[[str, Any], "str | list[str] | None"]


@functools.cache
def options(role: str) -> dict[str, dict[str, Any]]:
    """The role's options (its ``main`` entry point; the others repeat it)."""
    import yaml  # only here: the rest of inputs/ is stdlib and runs where PyYAML may be missing

    path = ROLES_DIR / role / "meta" / "argument_specs.yml"
    return yaml.safe_load(path.read_text())["argument_specs"]["main"]["options"]


def one_of(name: str, value: Any, choices: list[Any]) -> str | None:
    if value in choices:
        return None
    words = [str(c) for c in choices]
    listed = f"{', '.join(words[:-1])} or {words[-1]}" if len(words) > 1 else words[0]
    return problem(name, value, f"is not {listed}")


def option_problems(role: str, v: Mapping[str, Any], content: Mapping[str, Rule]) -> list[str]:
    """Every option of `role` that its inputs dict `v` carries (keys without the ``<role>_`` prefix),
    checked as the spec types it and by its content rule (keyed by the full variable name). An option
    the dict does not carry is left to ansible's own argument-spec check."""
    spec = options(role)
    unknown = sorted(set(content) - set(spec))
    if unknown:  # a rule for a variable the role no longer has: a bug here, not the operator's input
        raise KeyError(f"content rules for variables not in roles/{role}/meta/argument_specs.yml: {unknown}")
    found: list[str | list[str] | None] = []
    for name, option in spec.items():
        key = name.removeprefix(f"{role}_")
        if key in v:
            found.append(_option_problem(name, v[key], option, content.get(name)))
    return collect(*found)


def _option_problem(name: str, value: Any, option: Mapping[str, Any],
                    rule: Rule | None) -> str | list[str] | None:
    kind = option.get("type", "str")
    if kind == "bool":
        return strict_bool(name, value)
    if option.get("choices"):
        return one_of(name, value, option["choices"])
    if isinstance(rule, Range):
        if kind == "int":
            return integer(name, value, int(rule.low), int(rule.high))
        return number(name, value, rule.low, rule.high, low_open=rule.low_open)
    if rule is not None:
        return rule(name, value)
    if kind in ("int", "float"):  # every number the roles take has a range
        raise KeyError(f"{name}: a {kind} option without a Range in the content rules")
    if kind == "path":
        return abs_path(name, value)
    if kind == "list" and option.get("elements") in ("str", "path"):
        found = [string_list(name, value)]
        if option.get("elements") == "path" and isinstance(value, list):
            found += [abs_path(f"{name} entry", item) for item in value]
        return collect(*found)
    return None
