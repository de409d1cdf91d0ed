"""`ddtree plan` with an adaptive budget (issue 41): a profile's `speculative-ddtree-budget` may be a number,
`auto` or a comma list of widths; the planner resolves each through the decoder settings' one rule, sizes the
window and the scratch for the widest width, says what it does not count, and refuses a bad spelling with a
message naming the flag, the value and what it takes. Qwen3.6-27B-shaped header-only files, no process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ddtree_runtime.cli import main as ddtree_main
from ddtree_runtime.core.decoder_settings import DecoderSettings
from ddtree_runtime.planner import load_model_pair, plan_memory, propose_changes
from ddtree_runtime.planner.gpus import parse_shorthand
from ddtree_runtime.planner.profile_choice import profile_setting
from ddtree_runtime.planner.report import format_plan, plan_to_dict
from ddtree_runtime.planner.settings import from_flags, resolve, to_flags
from ddtree_runtime.planner.shapes import PlanError
from ddtree_runtime.planner.tune_fit import profile_label
from tests.fixtures_models import write_full_checkpoint_pair

REPO = Path(__file__).resolve().parents[2]
PROFILES = yaml.safe_load((REPO / "roles/sglang_service/vars/profiles.yml").read_text())[
    "sglang_service_profiles"
]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_full_checkpoint_pair(tmp_path_factory.mktemp("qwen36"), "qwen3.6-27b")


@pytest.fixture(scope="module")
def pair(files):
    return load_model_pair(*files)


def _plan(pair, profile: str, budget: object, gpus: str | None = None):
    flags = {**PROFILES[profile]["flags"], "speculative-ddtree-budget": budget}
    where = parse_shorthand(gpus or PROFILES[profile]["runs_on"]["gpus"])
    return plan_memory(pair, where, from_flags(flags), profile=profile)


@pytest.mark.parametrize(
    ("value", "kept"),
    [(16, 16), (16.0, 16), ("16", 16), ("auto", "auto"), (" auto ", "auto"), ("31,15", "15,31"),
     ((15, 31), "15,31"), ("7, 15,31", "7,15,31")],
)  # fmt: skip
def test_the_three_spellings_are_kept_as_the_flag_spells_them(value: object, kept: object) -> None:
    settings = from_flags({"speculative-ddtree-budget": value})
    assert settings.budget == kept
    assert to_flags(settings) == {"speculative-ddtree-budget": kept}
    assert from_flags(to_flags(settings)) == settings  # with_flag round-trips through the flags


@pytest.mark.parametrize(
    ("value", "words"),
    [("auto2", "'auto' or a comma list"), ("15,15", "each once"), (0, r"1\.\.1023, got 0"),
     ("15,x", "comma list"), ("1,2,3,4,5", r"2\.\.4 different budgets"), ("0,15", r"got 0 \(in 0,15\)"),
     ("15,1024", r"1\.\.1023, got 1024"), (True, "whole number")],
)  # fmt: skip
def test_a_bad_budget_is_refused_naming_the_flag_and_the_value(value: object, words: str) -> None:
    with pytest.raises(PlanError, match=words) as caught:
        from_flags({"speculative-ddtree-budget": value})
    message = str(caught.value)
    assert "budget" in message
    if isinstance(value, str):
        assert value.strip() in message or value.split(",")[0] in message


def test_auto_resolves_by_the_drafters_block_and_sizes_the_window_for_the_widest(pair) -> None:
    r = resolve(from_flags({"speculative-ddtree-budget": "auto"}), pair, gpu_mem_mib=140_000)
    assert r.decoder == DecoderSettings.resolve("auto", pair.draft.block_size)
    assert r.decoder.widths == (15, 31) and (r.budget, r.draft_tokens, r.verify_width) == (31, 32, 32)
    with pytest.raises(PlanError, match="the chain, which has one width"):
        resolve(from_flags({"speculative-ddtree-budget": "auto", "speculative-ddtree-topk-cap": 1}), pair,
                gpu_mem_mib=140_000)  # fmt: skip


def test_the_plan_reserves_the_widest_width_and_says_what_it_does_not_count(pair) -> None:
    fixed, auto = _plan(pair, "shadow-small", 31), _plan(pair, "shadow-small", "auto")
    assert auto.verdict.fits
    # The same memory as budget 31 alone: the widest width sizes the window and the scratch.
    assert auto.term("speculative_scratch").gib == fixed.term("speculative_scratch").gib
    assert auto.token_capacity == fixed.token_capacity
    assert not any("adaptive" in n for n in fixed.notes)
    note = next(n for n in auto.notes if n.startswith("adaptive widths auto(15,31)"))
    assert "32 rows per request" in note and "CUDA-graph estimate is SGLang's" in note
    table = format_plan(auto)
    assert "budget auto(15,31) (adaptive: verify 16 or 32 tokens a round, 32 reserved" in table
    doc = plan_to_dict(auto)
    assert doc["resolved"]["widths"] == [15, 31] and doc["resolved"]["budget"] == 31
    assert doc["settings"]["budget"] == "auto"
    assert plan_to_dict(fixed)["resolved"]["widths"] == []


def test_an_adaptive_profile_that_does_not_fit_is_offered_its_narrower_widths(pair) -> None:
    # balanced's 16 fp32 running requests: budget 16 fits the H200, the widest of auto (31) does not.
    assert _plan(pair, "balanced", 16).verdict.fits
    plan = _plan(pair, "balanced", "auto")
    assert not plan.verdict.fits and plan.verdict.term == "speculative_scratch"
    budget_changes = [c for c in propose_changes(plan) if "speculative-ddtree-budget" in c.flags]
    assert [c.summary for c in budget_changes] == ["speculative-ddtree-budget auto(15,31) -> 15"]
    assert budget_changes[0].plan.verdict.fits
    three = _plan(pair, "balanced", "15,23,31")
    summaries = [c.summary for c in propose_changes(three) if "speculative-ddtree-budget" in c.flags]
    assert summaries == ["speculative-ddtree-budget 15,23,31 -> 15"]  # 15,23 is still too wide here


def test_plan_cli_takes_auto_after_the_double_dash_and_refuses_a_bad_one(files, capsys) -> None:
    target, draft = files
    base = ["plan", "--model-path", str(target), "--draft-model-path", str(draft), "--json"]
    # shadow (8 fp32 requests on an H200 of its own) fits auto; shadow-small on its shared 75 GiB does not
    assert ddtree_main([*base, "--profile", "shadow", "--", "--speculative-ddtree-budget", "auto"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["resolved"]["widths"] == [15, 31] and "auto(15,31)" in doc["table"]
    assert ddtree_main([*base, "--profile", "shadow-small", "--", "--speculative-ddtree-budget", "auto"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert "speculative-ddtree-budget auto(15,31) -> 15" in [c["summary"] for c in doc["changes"]]
    flags = json.dumps({**PROFILES["balanced"]["flags"], "speculative-ddtree-budget": "15,31"})
    assert ddtree_main([*base, "--gpus", "1xH200", "--flags-json", flags]) == 1
    assert json.loads(capsys.readouterr().out)["changes"]
    assert ddtree_main([*base, "--profile", "shadow", "--", "--speculative-ddtree-budget", "auto2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ddtree plan: --speculative-ddtree-budget takes a whole number, 'auto' or a comma")
    assert "'auto2'" in err and len(err.strip().splitlines()) == 1


def test_the_figures_never_choose_an_adaptive_profile_and_tune_has_no_label_for_it() -> None:
    with pytest.raises(ValueError, match=r"adaptive, which no figures choose.*host_vars"):
        profile_setting({"speculative-ddtree-budget": "auto"})
    with pytest.raises(ValueError, match="adaptive"):
        profile_setting({"speculative-ddtree-budget": "15,31"})
    assert profile_setting({"speculative-ddtree-budget": 16}) == "16"
    assert profile_label({"speculative-ddtree-budget": "auto"}, 16) is None
    assert profile_label({"speculative-ddtree-budget": 16}, 16) == "16"
