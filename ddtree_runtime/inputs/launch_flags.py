"""Launch flags as profiles and inventories write them, as argument words (``ddtree plan`` splits the
launch flags with it too)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from .values import BOOL_WORDS, MAX_LIST_ITEMS, NUMBER, InputError, one_line, problem

_FLAG_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
_LONG_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]{0,63}")


def flag_value(name: str, value: Any) -> str | None:
    """A profile flag's value (profiles.yml spelling): true (bare flag), false/null (left out), a number
    or one printable word."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return problem(name, value, "is not a finite number")
    if isinstance(value, int | float):
        return None
    if not isinstance(value, str):
        return problem(name, value, "is not a flag value: true/false, a number or a string")
    if value.strip().lower() in BOOL_WORDS and not NUMBER.fullmatch(value.strip()):
        return problem(name, value, "is a boolean written as a string: write true or false without quotes "
                       "(a string renders as the flag's value)")
    if value == "":
        return problem(name, value, "is empty: give a value, or null to leave the flag out")
    return one_line(name, value)


def profile_flags(name: str, flags: Any) -> list[str]:
    if not isinstance(flags, Mapping):
        return [problem(name, flags, "is not a mapping of flag name -> value")]
    problems = []
    for key, value in flags.items():
        if not isinstance(key, str) or not _FLAG_NAME.fullmatch(key):
            problems.append(problem(f"{name} key", key, "is not a flag name as SGLang spells it, without "
                                    "the leading '--' (e.g. mem-fraction-static)"))
            continue
        bad = flag_value(f"{name}.{key}", value)
        if bad:
            problems.append(bad)
    return problems


def split_launch_flags(items: Iterable[Any], name: str = "sglang_extra_flags") -> list[str]:
    """Argument words from a flag list as inventories write it: ``--flag``, ``--flag=value``,
    ``--flag value`` (one item, one space: how ``sglang_extra_flags`` spells them) or a value of its own
    item (taken whole: it may hold spaces). Raises InputError naming the item."""
    argv: list[str] = []
    items = list(items)
    if len(items) > MAX_LIST_ITEMS:
        raise InputError(problem(name, f"{len(items)} items", f"is too long: at most {MAX_LIST_ITEMS}"))
    for i, item in enumerate(items):
        where = f"{name}[{i}]"
        if isinstance(item, bool) or not isinstance(item, str | int | float):
            raise InputError(problem(where, item, "is not a string: write flags as '--name value'"))
        text = str(item)
        bad = one_line(where, text)
        if bad:
            raise InputError(bad)
        if text.startswith("--"):
            head, space, value = text.partition(" ")
            flag = head.partition("=")[0]
            if not _LONG_FLAG.fullmatch(flag):
                raise InputError(problem(where, item, "is not a flag: --name (a-z, 0-9, '-'), then '=value' "
                                         "or ' value' (e.g. '--log-level info')"))
            if "=" in head or not space:  # --name or --name=value: one word, as written
                argv.append(text)
                continue
            if value == "" or value != value.strip() or " " in value:
                raise InputError(problem(where, item, "is not one flag and one value ('--name value'): put "
                                         "a value with spaces in an item of its own after '--name'"))
            argv += [flag, value]
        elif text.startswith("-") and not NUMBER.fullmatch(text):
            raise InputError(problem(where, item, "is not a flag SGLang takes: long flags start with '--'"))
        elif text == "":
            raise InputError(problem(where, item, "is empty"))
        else:
            if i == 0:
                raise InputError(problem(where, item, "is a value with no flag before it: start with "
                                         "'--name'"))
            argv.append(text)
    return argv


def launch_problems(name: str, items: Any) -> list[str]:
    if not isinstance(items, list):
        return [problem(name, items, "is not a list of flags (e.g. ['--log-level info'])")]
    try:
        split_launch_flags(items, name)
    except InputError as exc:
        return [str(exc)]
    return []


def flag_words(flags: Mapping[str, Any]) -> list[str]:
    """``--name`` / ``--name value`` words of a profile's flags (true: bare, false/null: left out)."""
    words: list[str] = []
    for key, value in flags.items():
        if value is None or value is False:
            continue
        words.append(f"--{key}")
        if value is not True:
            words.append(str(value))
    return words
