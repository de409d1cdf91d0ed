"""The hybrid gate through SGLang's real resolution pipeline: GDN hybrids (the production target,
Qwen3.6-27B) start trees with no override; other recurrent kinds are refused with what starts
instead; ``--speculative-ddtree-allow-hybrid`` starts only the chain case on them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.sglang.conftest import ddtree_argv, resolve

pytestmark = pytest.mark.sglang

# SGLang refuses the mamba radix cache's extra buffer on CPU (no state snapshots); GPU hosts keep it.
CPU = ("--disable-radix-cache",)
NEMOTRON_H = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hybrid_override_pattern": "M-M*" * 9,
    "num_hidden_layers": 36,
}


def _nemotron(tmp_path):
    from tests.fixtures_models import write_pair

    return write_pair(tmp_path, "qwen3-8b", target_overrides=NEMOTRON_H)


def test_gdn_hybrid_starts_a_tree_without_the_override(sglang_plugins, tmp_path):
    from tests.fixtures_models import write_pair

    target, draft = write_pair(tmp_path, "qwen3.6-27b")
    record, cfg = resolve(ddtree_argv(target, draft, *CPU, "--speculative-ddtree-budget", "63"))
    resolved = record._ddtree_resolved
    assert resolved.hybrid_kind == "gdn" and resolved.allow_hybrid is False
    assert resolved.decoder.budget == 63 and resolved.decoder.topk_cap is None
    assert resolved.contract["fc_in_features"] == 25600
    assert cfg.speculative_num_draft_tokens == 64  # the scratch rows SGLang reserves per request


def test_override_changes_nothing_on_a_gdn_hybrid(sglang_plugins, tmp_path):
    from tests.fixtures_models import write_pair

    target, draft = write_pair(tmp_path, "qwen3.6-27b")
    plain, _ = resolve(ddtree_argv(target, draft, *CPU))
    flagged, _ = resolve(ddtree_argv(target, draft, *CPU, "--speculative-ddtree-allow-hybrid"))
    a, b = plain._ddtree_resolved, flagged._ddtree_resolved
    assert a.allow_hybrid is False and b.allow_hybrid is True
    assert replace(a, allow_hybrid=True) == b


def test_mamba2_hybrid_is_refused_naming_what_starts_instead(sglang_plugins, tmp_path):
    from ddtree_runtime.sglang_plugin.refusals.resolution import DDTreeConfigError

    target, draft = _nemotron(tmp_path)
    with pytest.raises(DDTreeConfigError) as exc:
        resolve(ddtree_argv(target, draft, *CPU))
    text = str(exc.value)
    assert "NemotronHConfig" in text and "Mamba2" in text and "parent pointers" in text
    assert "--speculative-algorithm DFLASH" in text
    assert "--speculative-ddtree-topk-cap 1 --speculative-ddtree-budget 15" in text
    assert "--speculative-ddtree-allow-hybrid" in text


def test_override_starts_only_the_chain_case_on_an_unaudited_kind(sglang_plugins, tmp_path):
    from ddtree_runtime.sglang_plugin.refusals.resolution import DDTreeConfigError

    target, draft = _nemotron(tmp_path)
    with pytest.raises(DDTreeConfigError, match="starts the chain case only"):
        resolve(ddtree_argv(target, draft, *CPU, "--speculative-ddtree-allow-hybrid"))
    chain = ("--speculative-ddtree-allow-hybrid", "--speculative-ddtree-topk-cap", "1")
    record, _ = resolve(ddtree_argv(target, draft, *CPU, *chain))
    assert record._ddtree_resolved.hybrid_kind == "mamba2"
    assert record._ddtree_resolved.decoder.budget == 15  # block - 1: DFlash's chain, DFlash's commit


@pytest.mark.parametrize(
    ("kind", "words"),
    [("kda", "Kimi Delta Attention"), ("lightning", "seg_la"), ("linear-attention:x", "not audited")],
)
def test_every_unaudited_kind_is_refused_with_its_reason(kind, words):
    from ddtree_runtime.sglang_plugin.refusals.resolution import DDTreeConfigError, check_hybrid

    with pytest.raises(DDTreeConfigError, match=words):
        check_hybrid("/m", kind, "Cfg", allow_hybrid=False, chain=True, block=16)
    check_hybrid("/m", kind, "Cfg", allow_hybrid=True, chain=True, block=16)  # the chain starts
    for allow in (False, True):
        check_hybrid("/m", "gdn", "Qwen3_5TextConfig", allow_hybrid=allow, chain=False, block=16)
        check_hybrid("/m", None, "", allow_hybrid=allow, chain=False, block=16)


def test_hybrid_kind_is_sglangs_classification(sglang_plugins, tmp_path):
    from sglang.srt.arg_groups.model_override_base import model_config_of
    from sglang.srt.server_args import prepare_server_args

    from ddtree_runtime.sglang_plugin.refusals.resolution import hybrid_kind
    from tests.fixtures_models import write_pair

    kinds = {}
    for name, pair in {
        "qwen3.6-27b": write_pair(tmp_path / "a", "qwen3.6-27b"),
        "qwen3-8b": write_pair(tmp_path / "b", "qwen3-8b"),
        "nemotron-h": _nemotron(tmp_path / "c"),
    }.items():
        kinds[name] = hybrid_kind(model_config_of(prepare_server_args(ddtree_argv(*pair, *CPU))))
    assert kinds == {"qwen3.6-27b": "gdn", "qwen3-8b": None, "nemotron-h": "mamba2"}


def test_the_handshake_reports_the_target_hybrid(sglang_plugins, tmp_path):
    from ddtree_runtime.sglang_plugin.handshake import static_handshake
    from tests.fixtures_models import write_pair

    hybrid, _ = resolve(ddtree_argv(*write_pair(tmp_path / "a", "qwen3.6-27b"), *CPU))
    dense, _ = resolve(ddtree_argv(*write_pair(tmp_path / "b", "qwen3-8b"), *CPU))
    assert static_handshake(hybrid._ddtree_resolved)["target_hybrid"] is True
    assert static_handshake(dense._ddtree_resolved)["target_hybrid"] is False
