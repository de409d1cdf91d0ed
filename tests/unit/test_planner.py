"""The memory planner on Qwen3.6-27B-shaped files: every shipped profile, the verdicts, the fixes, the CLI.

The checkpoints are header-only (every tensor's real shape, no data; tests/fixtures_models.py), so
the planner reads exactly what it reads on a host. tests/sglang/test_planner_agrees.py checks the
same arithmetic against SGLang's own sizing code.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ddtree_runtime.cli import main as ddtree_main
from ddtree_runtime.planner import load_model_pair, plan_memory, propose_changes
from ddtree_runtime.planner.accounting import GIB, MIB
from ddtree_runtime.planner.cli import live_claim
from ddtree_runtime.planner.gpus import GpuFacts, from_declared, parse_nvidia_smi_csv, parse_shorthand, select
from ddtree_runtime.planner.report import format_plan, plan_to_dict
from ddtree_runtime.planner.settings import from_flags
from ddtree_runtime.planner.shapes import PlanError
from tests.fixtures_models import write_full_checkpoint_pair
from tests.unit._profile_plans import plan_where_meant

REPO = Path(__file__).resolve().parents[2]
PROFILES_FILE = REPO / "roles/sglang_service/vars/profiles.yml"
PROFILES = yaml.safe_load(PROFILES_FILE.read_text())["sglang_service_profiles"]
DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_full_checkpoint_pair(tmp_path_factory.mktemp("qwen36"), "qwen3.6-27b")


@pytest.fixture(scope="module")
def pair(files):
    return load_model_pair(*files)


def _plan(pair, gpus, flags, **kw):
    gpus = gpus if isinstance(gpus, list) else parse_shorthand(gpus)
    return plan_memory(pair, gpus, from_flags(flags), **kw)


def _where_meant(pair, name: str):
    return plan_where_meant(pair, PROFILES, name)


# ---------------------------------------------------------------------------------------------
# Every shipped profile


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_fits_where_it_is_meant_to_run(pair, name):
    plan = _where_meant(pair, name)
    assert plan.verdict.fits, format_plan(plan)
    assert plan.token_capacity >= plan.resolved.context_length
    assert plan.running_requests == plan.resolved.requested_running, "no profile asks for more than it gets"
    assert plan.term("headroom").gib >= plan.term("activations").gib


# What the two reference machines say about each profile (the closing note prints these tables).
EXPECTED = {
    ("balanced", "1xH200"): ("fits", None),
    ("balanced", "2xA6000"): ("does_not_fit", "target_weights"),
    ("balanced-tp2", "1xH200"): ("does_not_fit", "gpus"),
    ("balanced-tp2", "2xA6000"): ("fits", None),
    ("shadow", "1xH200"): ("fits", None),  # alone on the GPU; beside live it does not (below)
    ("shadow", "2xA6000"): ("does_not_fit", "target_weights"),
    ("shadow-small", "1xH200"): ("fits", None),
    ("shadow-small", "2xA6000"): ("does_not_fit", "target_weights"),
    ("shadow-small-nograph", "1xH200"): ("fits", None),
    ("shadow-small-nograph", "2xA6000"): ("does_not_fit", "target_weights"),
}


@pytest.mark.parametrize(("name", "gpus"), sorted(EXPECTED))
def test_each_profile_on_one_h200_and_on_two_a6000s(pair, name, gpus):
    plan = _plan(pair, gpus, PROFILES[name]["flags"], profile=name)
    assert (plan.verdict.status, plan.verdict.term) == EXPECTED[(name, gpus)], format_plan(plan)
    if not plan.verdict.fits:
        changes = propose_changes(plan)
        assert changes and all(c.plan.verdict.fits for c in changes)
        if plan.verdict.term == "gpus":  # balanced-tp2 on one H200: one GPU is enough there
            assert changes[0].summary == "tp-size 2 -> 1"
        else:  # a 27B profile on 48 GB GPUs is fixed by tensor parallelism
            assert any("tp-size 1 -> 2" in c.summary for c in changes)


def test_a_shadow_never_fits_beside_a_live_27b_on_the_same_h200(pair):
    h200 = parse_shorthand("1xH200")
    claimed = live_claim(pair, h200, from_flags(PROFILES["balanced"]["flags"]), None)
    assert 130 < claimed[0] < 140.4  # live holds its static pools and its headroom estimate
    for name in ("shadow", "shadow-small", "shadow-small-nograph"):
        plan = _plan(pair, h200, PROFILES[name]["flags"], profile=name, claimed_gib=claimed)
        assert plan.verdict.status == "does_not_fit" and plan.verdict.term == "target_weights", name
        assert propose_changes(plan, claimed_gib=claimed) == []  # nothing short of another GPU helps


def test_balanced_is_capped_by_its_mamba_cache_when_running_requests_outgrow_it(pair):
    flags = {**PROFILES["balanced"]["flags"], "max-running-requests": 32}
    plan = _plan(pair, "1xH200", flags)
    assert plan.verdict.fits and plan.running_requests == 16
    assert any("capped to 16" in note for note in plan.notes)


# ---------------------------------------------------------------------------------------------
# The terms against hybrid-verify.md's figures


def test_the_scratch_per_tree_row_and_per_slot_match_the_hybrid_verify_note(pair):
    linear = pair.target.linear
    assert len(linear.layers) == 48 and len(pair.target.full_attention_layers) == 16
    per_row_fp32 = linear.state_bytes_per_slot(1, ssm_bytes=4)
    assert per_row_fp32 / MIB == pytest.approx(146.8, abs=0.05)
    assert 17 * per_row_fp32 / GIB == pytest.approx(2.44, abs=0.01)  # budget 16: 17 rows per slot
    assert 17 * linear.state_bytes_per_slot(1, ssm_bytes=2) / GIB == pytest.approx(1.24, abs=0.01)
    assert linear.state_bytes_per_slot(2, ssm_bytes=4) * 2 == per_row_fp32  # TP splits heads and conv
    # 32 running requests at budget 16, fp32, when the state cache does not cap them: ~80 GiB of scratch
    plan = _plan(pair, "1xH200", {**PROFILES["balanced"]["flags"], "max-running-requests": 32,
                                  "max-mamba-cache-size": 160})  # 5 slots a request, overlapped
    assert plan.term("speculative_scratch").gib == pytest.approx(33 * 17 * per_row_fp32 / GIB)
    assert plan.term("speculative_scratch").gib > 80
    assert plan.verdict.status == "does_not_fit" and plan.verdict.term == "speculative_scratch"


def test_kv_bytes_count_full_attention_layers_only_on_the_hybrid(pair):
    assert pair.target.kv_bytes_per_token(1, 2) == 16 * 4 * 512 * 2  # 64 KiB
    assert pair.draft.kv_bytes_per_token(1, 2) == 5 * 8 * 256 * 2  # 20 KiB
    assert pair.target.kv_bytes_per_token(8, 2) == 16 * 1 * 512 * 2  # 4 KV heads: replicated past tp 4


def test_weights_per_rank_split_matrices_and_replicate_vectors(pair):
    w = pair.target.weights
    assert w.per_rank(1) == w.total
    assert w.per_rank(2) == w.replicated_bytes + -(-w.sharded_bytes // 2)
    assert w.skipped == ("mtp",) and w.skipped_bytes > 0


# ---------------------------------------------------------------------------------------------
# Verdicts and fixes


def test_a_long_context_fits_only_smaller_and_the_fix_says_how_long(pair):
    plan = _plan(pair, "1xH200", {**PROFILES["balanced"]["flags"], "context-length": 262144})
    assert plan.verdict.status == "smaller_context" and plan.verdict.max_context == plan.token_capacity
    changes = propose_changes(plan)
    ctx = [c for c in changes if "context-length" in c.flags]
    assert ctx and ctx[0].flags["context-length"] <= plan.token_capacity and ctx[0].plan.verdict.fits


def test_too_high_a_fraction_starves_the_cuda_graphs_and_a_lower_one_fits(pair):
    plan = _plan(pair, "1xH200", {**PROFILES["balanced"]["flags"], "mem-fraction-static": 0.95})
    assert plan.verdict.term == "activations" and plan.term("activations").estimate
    fractions = [c.flags["mem-fraction-static"] for c in propose_changes(plan)
                 if "mem-fraction-static" in c.flags]
    assert fractions and 0.85 <= fractions[0] < 0.95


def test_too_few_gpus_for_the_tp_size(pair):
    plan = _plan(pair, "1xA6000", PROFILES["balanced-tp2"]["flags"])
    assert plan.verdict.status == "does_not_fit" and plan.verdict.term == "gpus"
    assert "needs 2 GPU(s)" in plan.verdict.message and "offers 1" in plan.verdict.message


def test_the_fix_for_balanced_on_a6000s_is_tensor_parallel_and_it_fits(pair):
    plan = _plan(pair, "2xA6000", PROFILES["balanced"]["flags"])
    changes = propose_changes(plan)
    assert changes and all(c.plan.verdict.fits for c in changes)
    first = changes[0]
    assert first.flags["tp-size"] == 2
    refit = _plan(pair, "2xA6000", {**PROFILES["balanced"]["flags"], **first.flags})
    assert refit.verdict.fits and refit.token_capacity == first.plan.token_capacity


def test_the_plan_says_what_tp2_costs_and_saves(pair):
    """balanced-tp2 on ct129's two A6000s: half the weights and KV per GPU; the drafter head's
    per-round exchange is the top-K all-gather (issue 25), not the [rows, V] all-reduce."""
    plan = _where_meant(pair, "balanced-tp2")
    tp = plan_to_dict(plan)["tensor_parallel"]
    rows = 8 * 15  # 8 running requests x (block 16 - 1) depth rows
    assert tp["head_rows"] == rows and tp["topk"] == 16
    assert tp["exchange_bytes"] == rows * (2 * 16 + 1) * 4  # [rows, 2K + 1] fp32, to the one other rank
    assert tp["full_vocab_allreduce_bytes"] == rows * 248320 * 4  # ring all-reduce at TP 2: the tensor
    assert tp["weights_gib"] == pytest.approx(tp["weights_gib_tp1"] / 2, rel=0.01)
    assert tp["kv_kib_per_token"] * 2 == tp["kv_kib_per_token_tp1"]
    text = format_plan(plan)
    assert "15.8 KB per decode round" in text and "119.2 MB" in text and "NCCL +0.5 GiB" in text
    one = _plan(pair, "1xH200", PROFILES["balanced"]["flags"])
    assert plan_to_dict(one)["tensor_parallel"] is None and "tensor parallel" not in format_plan(one)
    chain = _plan(pair, "2xA6000", {**PROFILES["balanced-tp2"]["flags"], "speculative-ddtree-topk-cap": 1,
                                    "speculative-ddtree-budget": 15})
    assert plan_to_dict(chain)["tensor_parallel"]["topk"] == 0
    assert "DFLASH's own greedy head" in format_plan(chain)


def test_unknown_flags_are_listed_and_bad_values_refused():
    s = from_flags({"enable-metrics": True, "--tp-size": "2", "mem_fraction_static": "0.8"})
    assert s.tp_size == 2 and s.mem_fraction_static == 0.8 and s.ignored == ("enable-metrics",)
    with pytest.raises(PlanError, match="mem-fraction-static must be between 0 and 1"):
        from_flags({"mem-fraction-static": 1.5})
    with pytest.raises(PlanError, match="takes a number"):
        from_flags({"tp-size": "two"})


def test_tp_sizes_that_do_not_divide_the_gdn_heads_are_refused(pair):
    with pytest.raises(PlanError, match="does not divide the target's 48 GDN value heads"):
        _plan(pair, "8xA6000", {"tp-size": 5})


# ---------------------------------------------------------------------------------------------
# GPU facts


NVIDIA_SMI_SAMPLE = (
    "index, name, memory.total [MiB], memory.free [MiB], memory.used [MiB]\n"
    "0, NVIDIA RTX A6000, 49140 MiB, 48667 MiB, 473 MiB\n"
    "1, NVIDIA RTX A6000, 49140 MiB, 21003 MiB, 28137 MiB\n"
)


def test_nvidia_smi_csv_with_and_without_header_and_units():
    gpus = parse_nvidia_smi_csv(NVIDIA_SMI_SAMPLE)
    assert [(g.index, g.name, g.total_mib, g.free_mib) for g in gpus] == [
        (0, "NVIDIA RTX A6000", 49140, 48667), (1, "NVIDIA RTX A6000", 49140, 21003)]
    bare = parse_nvidia_smi_csv("1, NVIDIA H200, 143771, 143000, 771\n0, NVIDIA H200, 143771, 142000, 1771\n")
    assert [g.index for g in bare] == [0, 1] and bare[0].free_mib == 142000 and bare[0].source == "nvidia-smi"
    with pytest.raises(PlanError, match="printed no GPUs"):
        parse_nvidia_smi_csv("\n")
    with pytest.raises(PlanError, match="not a number"):
        parse_nvidia_smi_csv("0, NVIDIA H200, [N/A], 1\n")


def test_the_h200s_own_nvidia_smi_output_parses_and_plans(pair):
    """nvidia-smi --query-gpu=... --format=csv as the device's H200 printed it (an idle GPU)."""
    gpus = parse_nvidia_smi_csv((DATA / "nvidia-smi-h200.csv").read_text())
    assert [(g.index, g.name, g.total_mib, g.free_mib) for g in gpus] == [(0, "NVIDIA H200", 143771, 143156)]
    assert parse_shorthand("1xH200") == [GpuFacts(0, "NVIDIA H200", 143771, 143156, "shorthand")]
    plan = _plan(pair, gpus, PROFILES["balanced"]["flags"])
    assert plan.verdict.fits and plan.term("free").gib == pytest.approx(143156 / 1024)


def test_the_smallest_free_memory_of_the_tp_ranks_decides(pair):
    gpus = parse_nvidia_smi_csv(NVIDIA_SMI_SAMPLE)
    plan = _plan(pair, gpus, PROFILES["balanced-tp2"]["flags"])
    assert plan.term("free").gib == pytest.approx(21003 / 1024) and "GPU 1" in plan.term("free").label
    assert plan.verdict.status == "does_not_fit"


def test_declared_facts_and_the_shorthand():
    assert [g.name for g in parse_shorthand("2xA6000")] == ["NVIDIA RTX A6000"] * 2
    declared = from_declared([{"name": "NVIDIA RTX A6000", "count": 2}])
    assert [(g.index, g.total_mib, g.free_mib, g.source) for g in declared] == [
        (0, 49140, 48525, "inventory"), (1, 49140, 48525, "inventory")]
    custom = from_declared({"name": "Some GPU", "memory_total_mib": 1000, "memory_free_mib": 500})
    assert (custom[0].total_mib, custom[0].free_mib) == (1000, 500)
    with pytest.raises(PlanError, match="not a GPU the planner knows"):
        from_declared([{"name": "Mystery 9000"}])
    with pytest.raises(PlanError, match="COUNTxNAME"):
        parse_shorthand("lots of H200")
    assert [g.index for g in select(parse_shorthand("4xA6000"), tp=2, visible=[3, 2])] == [3, 2]
    with pytest.raises(PlanError, match="CUDA_VISIBLE_DEVICES names GPU"):
        select(parse_shorthand("1xH200"), tp=1, visible=[1])


# ---------------------------------------------------------------------------------------------
# The CLI and the host-side reader


def test_cli_table_json_and_exit_codes(files, capsys):
    target, draft = files
    base = ["plan", "--model-path", str(target), "--draft-model-path", str(draft)]
    assert ddtree_main([*base, "--profile", "balanced", "--gpus", "1xH200"]) == 0
    out = capsys.readouterr().out
    for text in ("target weights", "speculative scratch", "recurrent state", "KV cache", "verdict: FITS",
                 "CUDA graphs + activations (estimate)", "48 GDN + 16 full-attention layers"):
        assert text in out
    assert ddtree_main([*base, "--profile", "balanced", "--gpus", "2xA6000", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"]["status"] == "does_not_fit" and doc["verdict"]["term"] == "target_weights"
    assert doc["changes"] and doc["changes"][0]["flags"]["tp-size"] == 2
    # explicit SGLang flags after --, and --tp-size
    assert ddtree_main([*base, "--gpus", "2xA6000", "--tp-size", "2", "--json", "--", "--mamba-ssm-dtype",
                        "bfloat16", "--max-running-requests", "8", "--max-mamba-cache-size", "32",
                        "--mem-fraction-static", "0.85", "--context-length", "32768"]) == 0
    assert json.loads(capsys.readouterr().out)["resolved"]["tp_size"] == 2
    # a profile's runs_on is the default hardware (the shadow beside balanced on a two-H200 host)
    assert ddtree_main([*base, "--profile", "shadow"]) == 0
    out = capsys.readouterr().out
    assert "2 x NVIDIA H200" in out and "-> GPU 1" in out and "beside the live service (balanced)" in out
    # explicit GPUs plan the profile alone, unless a live one is named to plan beside
    assert ddtree_main([*base, "--profile", "shadow", "--gpus", "1xH200"]) == 0
    assert "beside" not in capsys.readouterr().out
    beside = ["--beside-profile", "balanced"]
    assert ddtree_main([*base, "--profile", "shadow", "--gpus", "1xH200", *beside]) == 1
    assert "beside the live service (balanced), which holds" in capsys.readouterr().out
    assert ddtree_main([*base, "--profile", "turbo", "--gpus", "1xH200"]) == 2
    assert "unknown profile 'turbo'" in capsys.readouterr().err
    assert ddtree_main(["plan", "--model-path", "/nonexistent", "--draft-model-path", str(draft),
                        "--gpus", "1xH200"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_model_files_py_runs_alone_on_a_host_and_its_description_plans_the_same(files, pair, tmp_path):
    """What a deploy does: send model_files.py to the host (stdlib python, no runtime), plan here."""
    script = tmp_path / "model_files.py"
    script.write_bytes((REPO / "ddtree_runtime/core/model_files.py").read_bytes())  # alone, no package
    target, draft = files
    out = subprocess.run([sys.executable, "-I", str(script), "describe", str(target), str(draft)],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    described = tmp_path / "models.json"
    described.write_text(out.stdout)
    from ddtree_runtime.planner.shapes import model_pair_from_description

    remote = model_pair_from_description(json.loads(out.stdout))
    assert remote == pair
    bad = subprocess.run([sys.executable, "-I", str(script), "describe", str(tmp_path / "nope"), str(draft)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "does not exist" in json.loads(bad.stdout)["error"]
    code = ddtree_main(["plan", "--models-json", str(described), "--profile", "balanced", "--gpus", "1xH200",
                        "--json"])
    assert code == 0


def test_plan_dict_is_json_and_names_every_term(pair):
    plan = _plan(pair, "1xH200", PROFILES["balanced"]["flags"], profile="balanced")
    doc = json.loads(json.dumps(plan_to_dict(plan)))
    keys = [t["key"] for t in doc["terms"]]
    assert keys == ["free", "context", "pre_load", "static", "target_weights", "draft_weights", "mm_reserve",
                    "speculative_scratch", "recurrent_state", "kv_cache", "headroom", "activations"]
    assert all(t["source"] for t in doc["terms"] if t["key"] not in ("free", "context"))
    assert doc["resolved"]["speculative_num_draft_tokens"] == 17 and doc["verdict"]["fits"] is True
