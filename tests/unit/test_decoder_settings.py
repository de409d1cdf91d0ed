"""The decoder's settings have one home (core/decoder_settings.py): the resolve rule, the limits, the labels,
and every reader of the budget (the plugin's flag, the planner, the lab engine, the scorer, the probe's
bound) takes them from there."""

from __future__ import annotations

import argparse

import pytest

from ddtree_runtime.core.decoder_settings import (
    CHAIN,
    MAX_BUDGET,
    VALIDATED_MAX_BUDGET,
    DecoderSettings,
    SettingsError,
    default_budget,
    parse_label,
    settings_for_label,
)


def test_the_resolve_rule_sizes_the_verify_and_the_reservation() -> None:
    default = DecoderSettings.resolve(None, 16)
    assert default == DecoderSettings(default_budget(16), 16) and default.budget == 15
    assert (default.verify_rows, default.kv_window, default.horizon) == (16, 16, 15)
    small = DecoderSettings.resolve(4, 16)  # the drafter's block still writes its 16 rows
    assert (small.verify_rows, small.kv_window, small.max_tokens_per_round) == (5, 16, 5)
    wide = DecoderSettings.resolve(63, 16, 8)
    assert (wide.verify_rows, wide.kv_window, wide.max_tokens_per_round) == (64, 64, 16)
    assert not wide.is_chain and wide.label is None  # a capped tree has no label


def test_the_chain_is_cap_one_at_block_minus_one_and_nothing_else() -> None:
    chain = DecoderSettings.chain(16)
    assert chain == DecoderSettings(15, 16, 1) and chain.is_chain and chain.label == CHAIN
    assert not DecoderSettings(7, 16, 1).is_chain  # a shorter capped tree runs the tree round
    assert not DecoderSettings(15, 16).is_chain and DecoderSettings(15, 16).label == "15"
    assert chain.flags() == {"speculative-ddtree-budget": 15, "speculative-ddtree-topk-cap": 1}
    assert settings_for_label(CHAIN, 32) == DecoderSettings.chain(32)
    assert settings_for_label("16", 16) == DecoderSettings(16, 16)


def test_the_limits_are_refused_never_cut() -> None:
    assert DecoderSettings(MAX_BUDGET, 16).verify_rows == 1024
    for budget in (0, -1, MAX_BUDGET + 1, True, 16.0, "16"):
        with pytest.raises(SettingsError, match="--speculative-ddtree-budget"):
            DecoderSettings(budget, 16)  # type: ignore[arg-type]
    for block in (1, 0, 1025, None):
        with pytest.raises(SettingsError, match="drafter block"):
            DecoderSettings(8, block)  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match="topk-cap must be at least 1, got 0"):
        DecoderSettings(8, 16, 0)


def test_the_validated_limit_is_trees_above_32_the_chain_exempt() -> None:
    assert DecoderSettings(VALIDATED_MAX_BUDGET, 16).validated
    assert not DecoderSettings(VALIDATED_MAX_BUDGET + 1, 16).validated
    assert DecoderSettings.chain(64).validated  # budget 63, but DFlash's own decode


@pytest.mark.parametrize("text", ["chain", "1", "16", "64", str(MAX_BUDGET)])
def test_canonical_labels_pass_unchanged(text: str) -> None:
    assert parse_label(text) == text


@pytest.mark.parametrize(
    "text", ["016", "0", "+16", "16.0", " 16", "16 ", "Chain", "", "١٦", "１６", str(MAX_BUDGET + 1), "99999",
             None, 16, "16/cap4", "\x00\xff"],
)  # fmt: skip
def test_anything_else_is_not_a_label(text: object) -> None:
    with pytest.raises(SettingsError) as exc:
        parse_label(text, what="--current")
    line = str(exc.value)
    assert line.startswith("--current ") and line.isprintable() and "\n" not in line


def test_every_reader_takes_the_same_maximum(tmp_path) -> None:
    """The plugin's flag, the planner's profile check, the lab engine's flag and the scorer's candidates
    refuse the first budget above MAX_BUDGET and take MAX_BUDGET."""
    from ddtree_runtime.core.counterfactual import Candidate
    from ddtree_runtime.planner.settings import from_flags
    from ddtree_runtime.planner.shapes import PlanError
    from ddtree_runtime.sglang_plugin.cli_args import add_ddtree_arguments
    from ddtree_runtime.tiny_engine.server_args import ServerArgsError, add_server_args, resolve

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_ddtree_arguments(parser)
    parsed = parser.parse_args(["--speculative-ddtree-budget", str(MAX_BUDGET)])
    assert parsed.speculative_ddtree_budget == MAX_BUDGET
    with pytest.raises(argparse.ArgumentError, match=f"at most {MAX_BUDGET}"):
        parser.parse_args(["--speculative-ddtree-budget", str(MAX_BUDGET + 1)])

    assert from_flags({"speculative-ddtree-budget": MAX_BUDGET}).budget == MAX_BUDGET
    with pytest.raises(PlanError, match=rf"budget must be in 1\.\.{MAX_BUDGET}"):
        from_flags({"speculative-ddtree-budget": MAX_BUDGET + 1})

    assert Candidate(MAX_BUDGET).budget == MAX_BUDGET
    with pytest.raises(ValueError, match=rf"1\.\.{MAX_BUDGET}"):
        Candidate(MAX_BUDGET + 1)

    lab = argparse.ArgumentParser()
    add_server_args(lab)

    def lab_resolve(*flags: str) -> dict:
        args = lab.parse_args(["--model-path", str(tmp_path), "--speculative-algorithm", "DDTREE",
                               "--speculative-draft-model-path", str(tmp_path), *flags])  # fmt: skip
        return resolve(args, target_config={}, draft_block_size=16)

    assert lab_resolve()["speculative_ddtree_budget"] == 16  # the lab engine's own default
    assert lab_resolve()["speculative_num_draft_tokens"] == 17  # it reports the verify rows there
    largest = lab_resolve("--speculative-ddtree-budget", str(MAX_BUDGET))
    assert largest["speculative_ddtree_budget"] == MAX_BUDGET
    with pytest.raises(ServerArgsError, match=rf"1\.\.{MAX_BUDGET}"):
        lab_resolve("--speculative-ddtree-budget", str(MAX_BUDGET + 1))
    with pytest.raises(ServerArgsError, match=rf"1\.\.{MAX_BUDGET}"):
        lab_resolve("--speculative-ddtree-budget", "0")


def test_the_planner_resolves_with_the_same_rule(tmp_path) -> None:
    from ddtree_runtime.planner import load_model_pair
    from ddtree_runtime.planner.settings import from_flags, resolve
    from tests.fixtures_models import write_full_checkpoint_pair

    pair = load_model_pair(*write_full_checkpoint_pair(tmp_path, "qwen3-8b"))
    for flags in ({}, {"speculative-ddtree-budget": 4}, {"speculative-ddtree-budget": 40},
                  {"speculative-ddtree-budget": 15, "speculative-ddtree-topk-cap": 1}):  # fmt: skip
        r = resolve(from_flags(flags), pair, gpu_mem_mib=80_000)
        want = DecoderSettings.resolve(flags.get("speculative-ddtree-budget"), pair.draft.block_size,
                                       flags.get("speculative-ddtree-topk-cap"))  # fmt: skip
        assert r.decoder == want
        assert (r.budget, r.verify_width, r.draft_tokens) == (want.budget, want.verify_rows, want.kv_window)


def test_the_probe_bounds_a_round_by_the_settings(tmp_path) -> None:
    """The live probe's accept-length bound: what one round can emit for the server's budget, block and
    cap (one token more per request from generate's meta, which counts the prefill's token)."""
    from ddtree_runtime.health.probe_report import Report
    from ddtree_runtime.health.probe_server_info import check_accept_length
    from ddtree_runtime.health.sglang_client import read_server_info

    def verdict(accept: float, handshake: dict) -> bool:
        report = Report(probe="live")
        report.handshake = handshake
        info = {"internal_states": [{"avg_spec_accept_length": accept}], "ddtree_handshake": handshake}
        check_accept_length(report, read_server_info(info), [], "http://127.0.0.1:1", 1.0, None)
        return report.figures["accept_length"] is not None

    tree8 = {"budget": 8, "topk_cap": None, "block_size": 16}
    assert verdict(9.0, tree8) and not verdict(9.5, tree8)  # at most 8 accepted + the bonus
    tree16 = tree8 | {"budget": 16}
    assert verdict(16.0, tree16) and not verdict(16.5, tree16)
    assert verdict(16.0, {"budget": 15, "topk_cap": 1, "block_size": 16})  # the chain
    assert verdict(16.0, {"budget": "x", "block_size": 16})  # no budget to read: the block bounds it


def test_auto_and_a_list_resolve_to_widths_the_widest_sizing_the_window() -> None:
    from ddtree_runtime.core.decoder_settings import AUTO, auto_widths

    auto = DecoderSettings.resolve(AUTO, 16)
    assert auto.widths == auto_widths(16) == (15, 31) and auto.budget == 31 and auto.adaptive
    assert (auto.verify_rows, auto.kv_window, auto.label) == (32, 32, None)  # no one label names it
    assert auto.at_budget(15) == DecoderSettings(15, 16) and auto.at_budget(31) == DecoderSettings(31, 16)
    assert auto.flags()["speculative-ddtree-budget"] == "15,31"
    listed = DecoderSettings.resolve("31, 7,15", 16, 8)  # sorted, capped alike
    assert listed.widths == (7, 15, 31) and listed.at_budget(7) == DecoderSettings(7, 16, 8)
    assert DecoderSettings.resolve((15, 31), 16) == auto
    assert DecoderSettings.resolve("16", 16) == DecoderSettings(16, 16)
    assert not DecoderSettings(16, 16).adaptive
    assert DecoderSettings(16, 16).budgets == (16,)
    assert auto_widths(MAX_BUDGET + 1) == (MAX_BUDGET,)  # the two coincide at the cap: one width
    with pytest.raises(SettingsError, match="not one of this server's widths"):
        auto.at_budget(16)


@pytest.mark.parametrize(
    ("budget", "cap", "message"),
    [
        ("15,15", None, "each once"),
        ("1,2,3,4,5", None, "2..4 different budgets"),
        ("15,x", None, "comma list"),
        ("15,1024", None, "1..1023"),
        ("0,15", None, "1..1023"),
        ("auto", 1, "the chain, which has one width"),
        (1.5, None, "whole number"),
    ],
)
def test_bad_widths_are_refused_with_the_rule(budget: object, cap: int | None, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        DecoderSettings.resolve(budget, 16, cap)  # type: ignore[arg-type]


def test_hand_built_widths_must_agree_with_the_budget() -> None:
    assert DecoderSettings(31, 16, None, (15, 31)).adaptive
    for widths in ((31, 15), (15, 16), (15,), (15, 15, 31)):
        with pytest.raises(SettingsError, match="adaptive widths"):
            DecoderSettings(31, 16, None, widths)


def test_the_tools_show_a_setting_one_way() -> None:
    from ddtree_runtime.core.decoder_settings import widths_text

    assert DecoderSettings(16, 16).shown == "16"
    assert DecoderSettings.chain(16).shown == "chain"
    assert DecoderSettings(16, 16, 4).shown == "16 (top-K cap 4)"
    assert DecoderSettings.resolve("auto", 16).shown == "auto(15,31)"
    assert DecoderSettings.resolve("15,31", 16).shown == "auto(15,31)"  # what auto picks, however asked
    assert DecoderSettings.resolve("15,23,31", 16).shown == "15,23,31"
    assert DecoderSettings.resolve("auto", 8, 4).shown == "auto(7,15) (top-K cap 4)"
    assert widths_text([15, 31], 16) == "auto(15,31)" and widths_text([15, 31], 8) == "15,31"
    assert widths_text((15, 31), None) == "15,31"  # no block: no way to tell auto


def test_the_lab_engine_verifies_one_width_and_says_where_auto_runs(tmp_path) -> None:
    """Its parser takes the plugin's three spellings (a rendered unit always parses); resolving refuses
    auto and a list with one line naming the SGLang plugin, and keeps a number as before."""
    from ddtree_runtime.tiny_engine.server_args import ServerArgsError, add_server_args, resolve

    lab = argparse.ArgumentParser(exit_on_error=False)
    add_server_args(lab)

    def lab_resolve(budget: str, algorithm: str = "DDTREE") -> dict:
        args = lab.parse_args(["--model-path", str(tmp_path), "--speculative-algorithm", algorithm,
                               "--speculative-draft-model-path", str(tmp_path),
                               "--speculative-ddtree-budget", budget])  # fmt: skip
        return resolve(args, target_config={}, draft_block_size=16)

    assert lab_resolve("16")["speculative_ddtree_budget"] == 16
    for spelling, shown in (("auto", "auto"), ("31,15", "15,31")):
        with pytest.raises(ServerArgsError) as caught:
            lab_resolve(spelling)
        flag = f"--speculative-ddtree-budget {shown}"
        want = f"the lab engine verifies one width; {flag} runs in the SGLang plugin (give one number here)"
        assert str(caught.value) == want
    with pytest.raises(ServerArgsError, match="'auto' or a comma list"):
        lab_resolve("auto2")
    with pytest.raises(ServerArgsError, match="each once"):
        lab_resolve("15,15")
    assert lab_resolve("auto", "DFLASH")["speculative_ddtree_budget"] == "auto"  # not DDTREE's to read
