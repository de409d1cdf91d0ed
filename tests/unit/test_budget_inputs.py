"""The budget flag at preflight (issue 41): a service's `speculative-ddtree-budget` (the profile's, a host's
override, a budget among the extra flags) is a number, `auto` or a comma list of widths; a bad one is refused
naming where it came from, the value and the rule, before anything changes; a good one reaches the unit's
ExecStart as one word, unchanged. The rules are called directly and through the roles' filter plugin, which
loads ddtree_runtime/inputs/ by file path (no package): the decoder settings' rule must reach it there too.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ddtree_runtime.inputs import role_checks, service_command, systemd_quoting
from ddtree_runtime.inputs.decoder_flags import decoder_problems, extra_budget

REPO = Path(__file__).resolve().parents[2]
FLAGS = {"tp-size": 1, "mem-fraction-static": 0.85, "speculative-ddtree-budget": 16}
VALID: dict[str, Any] = {
    "profile": "balanced", "profile_data": {"description": "test", "port": 30000, "flags": FLAGS},
    "unit_name": "sglang-qwen", "port": 0, "effective_port": 30000, "host": "127.0.0.1", "engine": "sglang",
    "release_dir": "/opt/ddtree/releases/x", "model_path": "/srv/models/target",
    "draft_model_path": "/srv/models/draft", "speculative_algorithm": "DDTREE", "enable_metrics": True,
    "plan": True, "extra_flags": [], "flag_overrides": {}, "engine_env": {}, "extra_env": {},
    "secret_env": {}, "cuda_visible_devices": "", "user": "sglang", "group": "sglang",
    "unit_dir": "/etc/systemd/system", "env_dir": "/etc/sglang", "state_dir": "/var/lib/ddtree/state",
    "rollback_dir": "/var/lib/ddtree/rollback",
    "ready_timeout": 1800, "start_timeout": 3600, "stop_timeout": 120, "stable_s": 60, "restart_sec": 30,
    "start_limit_interval": 7200, "start_limit_burst": 3, "allowed_clients": [],
    "device_allow": ["char-nvidia rwm"], "sandbox": {"ProtectSystem": "strict"}, "sandbox_disable": [],
}  # fmt: skip


def _with(overrides: dict[str, Any] | None = None, extra: list[str] | None = None,
          profile: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """The role's inputs as preflight builds them: the overrides merged over the profile's flags."""
    overrides = overrides or {}
    flags = {**FLAGS, **(profile or {}), **overrides}
    return {**VALID, "profile_data": {**VALID["profile_data"], "flags": flags}, "flag_overrides": overrides,
            "extra_flags": extra or []}  # fmt: skip


GOOD = [16, "16", "auto", "15,31", "31,15", "7,15,23,31", 1023]
BAD = [
    ("auto2", "takes a whole number, 'auto' or a comma list"),
    ("15,15", r"2\.\.4 different budgets, each once"),
    (0, r"is not a whole number in 1\.\.1023"),
    (16.0, "takes a whole number"),  # would render as 16.0, which the plugin's parser refuses
    ("15,x", "takes a whole number, 'auto' or a comma list"),
    ("1,2,3,4,5", r"2\.\.4 different budgets"),
    ("15,1024", "holds budget 1024"),
    ("15, 31", "holds spaces: write the widths as one word"),  # one plain ExecStart word, always
    (True, "takes a whole number"),
]


@pytest.mark.parametrize("value", GOOD)
def test_every_spelling_the_plugin_takes_passes(value: object) -> None:
    assert decoder_problems("f", {"speculative-ddtree-budget": value}) == []
    assert role_checks.service_problems(_with({"speculative-ddtree-budget": value})) == []


@pytest.mark.parametrize(("value", "words"), BAD)
def test_a_bad_budget_is_named_with_its_value_and_the_rule(value: object, words: str) -> None:
    found = decoder_problems("sglang_service_flag_overrides", {"speculative-ddtree-budget": value})
    assert len(found) == 1, found
    assert found[0].startswith("sglang_service_flag_overrides.speculative-ddtree-budget")
    assert repr(value) in found[0] or ascii(value) in found[0]
    assert re.search(words, found[0]), found[0]


def test_the_chain_has_one_width_and_a_cap_must_be_a_count() -> None:
    def problems(budget: object, cap: int) -> list[str]:
        flags = {"speculative-ddtree-budget": budget, "speculative-ddtree-topk-cap": cap}
        return decoder_problems("p", flags)

    chain_auto = problems("auto", 1)
    assert chain_auto and "the chain, which has one width" in chain_auto[0]
    assert problems(15, 1) == [] and problems("auto", 4) == []
    bad_cap = decoder_problems("p", {"speculative-ddtree-topk-cap": 0})
    assert bad_cap and bad_cap[0].startswith("p.speculative-ddtree-topk-cap: 0 is not a whole number")


def test_service_problems_name_where_the_budget_came_from() -> None:
    def named(problems: list[str]) -> list[str]:
        return [re.split(r":? ['0-9]| takes", p)[0] for p in problems]

    from_host = role_checks.service_problems(_with({"speculative-ddtree-budget": "auto2"}))
    assert named(from_host) == ["sglang_service_flag_overrides.speculative-ddtree-budget"]
    from_profile = role_checks.service_problems(_with(profile={"speculative-ddtree-budget": 0}))
    assert named(from_profile) == ["the profile's flags.speculative-ddtree-budget"]
    from_extra = role_checks.service_problems(_with(extra=["--speculative-ddtree-budget 15,x"]))
    assert named(from_extra) == ["sglang_service_extra_flags.speculative-ddtree-budget"]
    # the cap from the host with the profile's auto: the chain has one width
    capped = role_checks.service_problems(_with({"speculative-ddtree-topk-cap": 1},
                                                profile={"speculative-ddtree-budget": "auto"}))  # fmt: skip
    assert len(capped) == 1 and "one width" in capped[0]
    assert extra_budget(["--log-level", "info", "--speculative-ddtree-budget=auto"]) == "auto"
    assert extra_budget(["--speculative-ddtree-budget", "8", "--speculative-ddtree-budget=16"]) == "16"
    assert extra_budget(["--log-level", "info"]) is None


@pytest.mark.parametrize("value", ["auto", "15,31", 16])
def test_a_good_budget_renders_as_one_word_unchanged(value: object) -> None:
    argv = service_command.service_argv(_with({"speculative-ddtree-budget": value}))
    at = argv.index("--speculative-ddtree-budget")
    assert argv[at + 1] == str(value) and argv[at + 2].startswith("--")
    line = systemd_quoting.exec_line(argv)
    assert f"--speculative-ddtree-budget {value} \\" in line  # a plain word: no quotes, no split


def _filter_plugin() -> ModuleType:
    """ansible/filter_plugins/ddtree_inputs.py as Ansible loads it (it loads inputs/ by file path)."""
    path = REPO / "ansible/filter_plugins/ddtree_inputs.py"
    spec = importlib.util.spec_from_file_location("ddtree_inputs_filter_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_filter_plugin_reaches_the_same_rule_without_the_package() -> None:
    pytest.importorskip("ansible")
    filters = _filter_plugin().FilterModule().filters()
    problems = filters["ddtree_service_problems"]
    assert problems(_with({"speculative-ddtree-budget": "auto"})) == []
    found = problems(_with({"speculative-ddtree-budget": "1,2,3,4,5"}))
    assert found == role_checks.service_problems(_with({"speculative-ddtree-budget": "1,2,3,4,5"}))
    # loaded by path there: the decoder settings came in by their own path, not as ddtree_runtime.core
    loaded = sys.modules["ddtree_deploy_inputs.decoder_flags"]
    assert loaded._rule().__name__ == "ddtree_deploy_decoder_settings"
    assert loaded._rule().MAX_WIDTHS == 4
