"""A full DDTREE command line through SGLang's own parser and resolution pipeline (0.5.23)."""

from __future__ import annotations

import pytest

from ddtree_runtime.core.decoder_settings import DecoderSettings
from tests.sglang.conftest import ddtree_argv, resolve

pytestmark = pytest.mark.sglang


def test_full_command_line_resolves_with_dflash_defaults_and_ddtree_sizes(sglang_plugins, pair):
    target, draft = pair
    record, cfg = resolve(
        ddtree_argv(
            target,
            draft,
            "--speculative-ddtree-budget",
            "24",
            "--speculative-ddtree-topk-cap",
            "4",
            "--mem-fraction-static",
            "0.8",
            "--context-length",
            "4096",
            "--enable-metrics",
        )
    )
    assert cfg.speculative_algorithm == "DDTREE"
    # DFLASH's defaults, applied by delegating to SGLang's own _handle_dflash
    assert cfg.speculative_num_steps == 1
    assert cfg.speculative_eagle_topk == 1
    assert cfg.max_running_requests == 48
    # drafter block from the draft config (16); verify width budget + 1 (25) decoupled from it
    assert cfg.speculative_dflash_block_size == 16
    assert cfg.speculative_num_draft_tokens == 25
    assert cfg.disable_overlap_schedule is False  # trees keep SGLang's overlap scheduler, as DFLASH does
    assert cfg.attention_backend == "triton"
    assert cfg.mem_fraction_static == 0.8 and cfg.context_length == 4096
    settings = record._ddtree_resolved
    assert settings.decoder == DecoderSettings(budget=24, block_size=16, topk_cap=4)
    assert settings.contract["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert settings.contract["fc_in_features"] == 20480


def test_default_budget_is_one_node_per_draft_position(sglang_plugins, pair):
    record, cfg = resolve(ddtree_argv(*pair))
    assert record._ddtree_resolved.decoder.budget == 15
    assert cfg.speculative_num_draft_tokens == 16


def test_small_budget_keeps_the_drafter_block_as_kv_reservation(sglang_plugins, pair):
    record, cfg = resolve(ddtree_argv(*pair, "--speculative-ddtree-budget", "4"))
    assert record._ddtree_resolved.decoder.budget == 4
    # the draft block and the verify write the same reserved window: reserve max(block, budget+1)
    assert cfg.speculative_num_draft_tokens == 16
    assert cfg.speculative_dflash_block_size == 16


def test_explicit_max_running_requests_is_kept(sglang_plugins, pair):
    _, cfg = resolve(ddtree_argv(*pair, "--max-running-requests", "8"))
    assert cfg.max_running_requests == 8


def test_dflash_block_size_flag_overrides_the_draft_config(sglang_plugins, pair):
    record, cfg = resolve(ddtree_argv(*pair, "--speculative-dflash-block-size", "8"))
    assert cfg.speculative_dflash_block_size == 8
    assert record._ddtree_resolved.decoder.budget == 7


def test_dflash_resolution_is_unchanged_by_the_plugin(sglang_plugins, pair):
    target, draft = pair
    argv = ddtree_argv(target, draft)
    argv[argv.index("DDTREE")] = "DFLASH"
    record, cfg = resolve(argv)
    assert cfg.speculative_num_draft_tokens == 16
    assert cfg.disable_overlap_schedule is False
    assert getattr(record, "_ddtree_resolved", None) is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "--speculative-ddtree-budget must be at least 1, got 0"),
        ("many", "--speculative-ddtree-budget takes a whole number, 'auto' or a comma list (15,31), got"),
        ("15,15", "give 2..4 different budgets, each once"),
        ("5000", "--speculative-ddtree-budget must be at most 1023"),
    ],
)
def test_bad_budget_is_rejected_by_sglangs_parser(sglang_plugins, pair, capsys, value, message):
    from sglang.srt.server_args import prepare_server_args

    with pytest.raises(SystemExit) as exc:
        prepare_server_args(ddtree_argv(*pair, "--speculative-ddtree-budget", value))
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_auto_resolves_to_two_widths_the_widest_reserving_the_window(sglang_plugins, pair):
    record, cfg = resolve(ddtree_argv(*pair, "--speculative-ddtree-budget", "auto"))
    settings = record._ddtree_resolved
    assert settings.decoder == DecoderSettings(31, 16, None, (15, 31)) and settings.decoder.adaptive
    assert cfg.speculative_num_draft_tokens == 32  # the widest width's verify rows: what SGLang reserves
    assert settings.price_table  # an adaptive server chooses by its own prices: measured whatever the flag
    capped = ("--speculative-ddtree-budget", "4,15", "--speculative-ddtree-topk-cap", "8")
    record, cfg = resolve(ddtree_argv(*pair, *capped))
    assert record._ddtree_resolved.decoder == DecoderSettings(15, 16, 8, (4, 15))
    assert cfg.speculative_num_draft_tokens == 16


def test_auto_widths_out_of_range_or_on_the_chain_fail_resolution_with_the_rule(sglang_plugins, pair):
    from ddtree_runtime.sglang_plugin.refusals.resolution import DDTreeConfigError

    chain = ("--speculative-ddtree-budget", "auto", "--speculative-ddtree-topk-cap", "1")
    with pytest.raises(DDTreeConfigError, match="chain, which has one width"):
        resolve(ddtree_argv(*pair, *chain))
    with pytest.raises(DDTreeConfigError, match=r"1\.\.1023"):
        resolve(ddtree_argv(*pair, "--speculative-ddtree-budget", "15,2000"))


def test_bad_topk_cap_is_rejected_by_sglangs_parser(sglang_plugins, pair, capsys):
    from sglang.srt.server_args import prepare_server_args

    with pytest.raises(SystemExit):
        prepare_server_args(ddtree_argv(*pair, "--speculative-ddtree-topk-cap", "-3"))
    assert "--speculative-ddtree-topk-cap must be at least 1, got -3" in capsys.readouterr().err


def test_num_draft_tokens_conflicts_with_the_budget(sglang_plugins, pair):
    from ddtree_runtime.sglang_plugin.refusals.resolution import DDTreeConfigError

    with pytest.raises(DDTreeConfigError, match="drop --speculative-num-draft-tokens"):
        resolve(ddtree_argv(*pair, "--speculative-num-draft-tokens", "16"))


def test_cpu_device_is_refused_through_dflash(sglang_plugins, pair):
    from ddtree_runtime.sglang_plugin.refusals.resolution import DDTreeConfigError

    argv = ddtree_argv(*pair)
    argv[argv.index("cuda")] = "cpu"
    with pytest.raises(DDTreeConfigError, match=r"DDTREE builds on DFLASH.*not supported.*device 'cpu'"):
        resolve(argv)


def test_width_mismatch_fails_at_resolution(sglang_plugins, tmp_path):
    from ddtree_runtime.core.model_files import ContractError
    from tests.fixtures_models import write_pair

    # the field failure: a drafter trained on 5 target layers, given a 1-layer capture width
    target, draft = write_pair(tmp_path, "qwen3-8b", fc_shape=(4096, 4096))
    expected = r"drafter fc expects \[N, 4096\] but the target captures \[N, 20480\]"
    with pytest.raises(ContractError, match=expected):
        resolve(ddtree_argv(target, draft))


def test_unknown_without_the_plugin_is_sglangs_own_error(pair):
    """The same name without registration: SGLang's message (what the diagnose tool keys on)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    with pytest.raises(ValueError, match="Unknown speculative algorithm name: DDTREE2"):
        SpeculativeAlgorithm.from_string("DDTREE2")


def test_trees_run_overlapped_unless_the_operator_turns_overlap_off(sglang_plugins, pair):
    tree = ("--speculative-ddtree-budget", "16")
    _, cfg = resolve(ddtree_argv(*pair, *tree))
    assert cfg.disable_overlap_schedule is False
    _, cfg = resolve(ddtree_argv(*pair, *tree, "--disable-overlap-schedule"))
    assert cfg.disable_overlap_schedule is True


def test_chain_configuration_keeps_dflashs_overlap_scheduler(sglang_plugins, pair):
    _, cfg = resolve(
        ddtree_argv(*pair, "--speculative-ddtree-topk-cap", "1", "--speculative-ddtree-budget", "15")
    )
    assert cfg.disable_overlap_schedule is False
    assert cfg.speculative_num_draft_tokens == 16 == cfg.speculative_dflash_block_size


def test_a_budget_above_the_gpu_validated_one_starts_with_a_warning_naming_the_evidence(
    sglang_plugins, pair, monkeypatch
):
    from ddtree_runtime.sglang_plugin import algorithm

    warnings: list[str] = []
    monkeypatch.setattr(algorithm.logger, "warning", lambda msg, *args: warnings.append(msg % args))
    resolve(ddtree_argv(*pair, "--speculative-ddtree-budget", "64"))
    assert any("above 32" in w and "gpu-lab-server.md" in w for w in warnings), warnings
    warnings.clear()
    resolve(ddtree_argv(*pair, "--speculative-ddtree-budget", "32"))
    assert not any("above 32" in w for w in warnings), warnings


def test_tree_servers_on_cuda_warm_every_batch_size_before_they_say_ready(sglang_plugins, pair):
    """The plugin adds its start-up warm-up (sglang_plugin/warmup.py) after the operator's own, on
    CUDA with graphs; not without graphs, not for the chain (DFLASH's own decode). The CPU lab's
    servers (device cpu) never get it: tests/unit/test_plugin_warmup.py."""
    _, cfg = resolve(ddtree_argv(*pair, "--device", "cuda", "--warmups", "voice_chat"))
    assert cfg.warmups == "voice_chat,ddtree_batches"
    _, no_graphs = resolve(ddtree_argv(*pair, "--device", "cuda", "--disable-cuda-graph"))
    assert "ddtree_batches" not in (no_graphs.warmups or "")
    _, chain = resolve(
        ddtree_argv(
            *pair,
            "--device",
            "cuda",
            "--speculative-ddtree-topk-cap",
            "1",
            "--speculative-ddtree-budget",
            "15",
        )
    )
    assert "ddtree_batches" not in (chain.warmups or "")


def test_the_worker_receives_the_typed_settings_and_builds_its_round_from_them(sglang_plugins, pair):
    """The record carries one ``PluginSettings`` (pickled to the schedulers with it); the round's
    configuration is built from its decoder settings, with the window SGLang reserves."""
    import pickle

    from ddtree_runtime.sglang_plugin.algorithm import PluginSettings
    from ddtree_runtime.sglang_plugin.round.tree_round import RoundConfig

    record, cfg = resolve(ddtree_argv(*pair, "--speculative-ddtree-budget", "4"))
    settings = record._ddtree_resolved
    assert isinstance(settings, PluginSettings)
    assert pickle.loads(pickle.dumps(record))._ddtree_resolved == settings
    round_cfg = RoundConfig.from_settings(settings.decoder, mask_token_id=11, page_size=16)
    assert (round_cfg.budget, round_cfg.block_size, round_cfg.topk_cap) == (4, 16, None)
    assert round_cfg.verify_rows == 5 and round_cfg.write_window == cfg.speculative_num_draft_tokens == 16
    assert (round_cfg.mask_token_id, round_cfg.page_size) == (11, 16)
