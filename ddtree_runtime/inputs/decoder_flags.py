"""The DDTree decoder flags a service starts with (``speculative-ddtree-budget``,
``speculative-ddtree-topk-cap``), checked at preflight by the decoder settings' own rule
(``core/decoder_settings``): a budget is a number, ``auto`` or a comma list of widths (``15,31``), each
width within the limits, and the chain (top-K cap 1) has one width. The drafter's block is not known here
(``auto``'s widths follow it): the fit check (``ddtree plan``) resolves the rest.

The filter plugin loads this folder by file path, without the package
(ansible/filter_plugins/ddtree_inputs.py): then the rule's module is loaded by its own path (it is stdlib
only, like this folder).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from .values import problem

BUDGET = "speculative-ddtree-budget"
TOPK_CAP = "speculative-ddtree-topk-cap"
_PATH_NAME = "ddtree_deploy_decoder_settings"  # the rule's module when loaded by path


def _rule() -> ModuleType:
    if (__package__ or "").startswith("ddtree_runtime."):
        from ddtree_runtime.core import decoder_settings

        return decoder_settings
    if _PATH_NAME not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "core" / "decoder_settings.py"
        spec = importlib.util.spec_from_file_location(_PATH_NAME, path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        sys.modules[_PATH_NAME] = module  # before it runs: its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[_PATH_NAME]


def decoder_problems(name: str, flags: Any) -> list[str]:
    """What is wrong with the budget and the top-K cap among ``flags`` (profiles.yml spelling, the host's
    overrides applied); [] when nothing, or when neither is set (the plugin's defaults)."""
    if not isinstance(flags, Mapping):
        return []  # profile_flags says it is no mapping
    ds = _rule()
    budget, cap = flags.get(BUDGET), flags.get(TOPK_CAP)
    where = f"{name}.{BUDGET}"
    if cap is not None and cap is not False:
        whole = cap if isinstance(cap, int) and not isinstance(cap, bool) else None
        if isinstance(cap, str) and cap.isascii() and cap.isdigit():
            whole = int(cap)  # a flag list's word
        if whole is None or whole < 1:
            return [problem(f"{name}.{TOPK_CAP}", cap, "is not a whole number of at least 1 (1: the chain)")]
        cap = whole
    if budget is None or budget is False:
        return []
    if isinstance(budget, str) and budget != "".join(budget.split()):
        return [problem(where, budget, "holds spaces: write the widths as one word, 15,31 (the unit's "
                        "ExecStart keeps it one plain word)")]  # fmt: skip
    try:  # a float (16.0) is refused too: it would render as "16.0", which the plugin's parser refuses
        spec = ds.parse_budget(budget, what=where)
    except ds.SettingsError as exc:
        return [str(exc)]
    widths = () if spec == ds.AUTO else (spec if isinstance(spec, tuple) else (spec,))
    rule = f"1..{ds.MAX_BUDGET} (verify width = budget + 1)"
    for b in widths:
        if not 1 <= b <= ds.MAX_BUDGET:
            said = f"is not a whole number in {rule}" if isinstance(spec, int) else (
                f"holds budget {b}: each budget is a whole number in {rule}")  # fmt: skip
            return [problem(where, budget, said)]
    adaptive = spec == ds.AUTO or isinstance(spec, tuple)
    if adaptive and cap == 1:
        return [problem(where, budget, f"is adaptive, but {TOPK_CAP} 1 is the chain, which has one width: "
                        f"drop the cap, or give {BUDGET} one number")]  # fmt: skip
    return []


def extra_budget(words: list[str]) -> str | None:
    """The budget a flag list sets (``--speculative-ddtree-budget X`` or ``=X``; the last wins, as in
    argparse), or None."""
    found = None
    for i, word in enumerate(words):
        if word == f"--{BUDGET}" and i + 1 < len(words):
            found = words[i + 1]
        elif word.startswith(f"--{BUDGET}="):
            found = word.partition("=")[2]
    return found
