"""The GPU lab's production-shape case on CPU: the 27B pair it writes, the trace analysis it prints.

The device runs them (``cases prod``); here the pair is checked against the project's hidden-state
contract, the analysis against a trace whose figures are known, and the span label it counts
against what the installed SGLang writes (``build_step_span_name``): a renamed label would leave
every round uncounted.
"""

from __future__ import annotations

import gzip
import json
import types
from pathlib import Path

import pytest

from ddtree_runtime.core.contract import load_contract

prod_shape = pytest.importorskip("ddtree_sglang_gpu_lab.prod_shape")
profile_gaps = pytest.importorskip("ddtree_sglang_gpu_lab.profile_gaps")
cases = pytest.importorskip("ddtree_sglang_gpu_lab.cases")

pytestmark = pytest.mark.sglang


def _lab_hybrid_pair(root: Path) -> Path:
    """The keys of the lab hybrid pair's configs that the prod pair keeps (ddtree tiny-engine make-models)."""
    (root / "target").mkdir(parents=True)
    (root / "draft").mkdir()
    target = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 64,
              "num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
              "bos_token_id": 256, "eos_token_id": 256, "mamba_ssm_dtype": "float32"}  # fmt: skip
    draft = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64,
             "num_hidden_layers": 2, "num_target_layers": 4, "block_size": 16,
             "dflash_config": {"target_layer_ids": [1, 2], "mask_token_id": 259}}  # fmt: skip
    (root / "target/config.json").write_text(json.dumps(target))
    (root / "target/tokenizer.json").write_text("{}")
    (root / "draft/config.json").write_text(json.dumps(draft))
    return root


def test_the_prod_pair_states_qwen36_27bs_capture_width(tmp_path):
    pair = prod_shape.write_prod_pair(_lab_hybrid_pair(tmp_path / "hybrid"), tmp_path / "prod")
    contract = load_contract(pair / "target", pair / "draft")
    assert contract.target_layer_ids == (1, 16, 31, 46, 61)
    assert contract.capture_width == contract.fc_in_features == 25600
    assert contract.hybrid and contract.mask_token_id == 259
    target = json.loads((pair / "target/config.json").read_text())
    assert target["num_hidden_layers"] == 64 and target["layer_types"].count("linear_attention") == 48
    assert (pair / "target/tokenizer.json").is_file()


def _lab_dense_pair(root: Path) -> Path:
    """The keys of the lab dense pair's configs that the 8B pair keeps."""
    (root / "target").mkdir(parents=True)
    (root / "draft").mkdir()
    target = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
              "num_hidden_layers": 4, "bos_token_id": 256, "eos_token_id": 256}  # fmt: skip
    draft = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64,
             "num_hidden_layers": 2, "num_target_layers": 4, "block_size": 16,
             "dflash_config": {"target_layer_ids": [1, 2], "mask_token_id": 259}}  # fmt: skip
    (root / "target/config.json").write_text(json.dumps(target))
    (root / "target/tokenizer.json").write_text("{}")
    (root / "draft/config.json").write_text(json.dumps(draft))
    return root


def test_the_dense8b_pair_states_qwen3_8bs_capture_width(tmp_path):
    pair = prod_shape.write_dense8b_pair(_lab_dense_pair(tmp_path / "dense"), tmp_path / "prod8b")
    contract = load_contract(pair / "target", pair / "draft")
    assert contract.target_layer_ids == (1, 9, 17, 25, 33)
    assert contract.capture_width == contract.fc_in_features == 20480
    assert not contract.hybrid and contract.mask_token_id == 259
    target = json.loads((pair / "target/config.json").read_text())
    assert (target["num_hidden_layers"], target["hidden_size"], target["vocab_size"]) == (36, 4096, 151936)


def test_prod_specs_name_the_shape_and_the_eager_round():
    spec = cases.prod_spec("ddtree15-dense8b")
    assert spec.pair == "prod8b" and spec.overrides["speculative-ddtree-budget"] == 15
    assert "mamba-ssm-dtype" not in spec.overrides and "dummy" in spec.extra
    eager = cases.prod_spec("ddtree16-fp32-eager")
    assert eager.pair == "prod" and eager.env["SGLANG_DDTREE_ROUND_GRAPHS"] == "0"
    assert "SGLANG_DDTREE_ROUND_GRAPHS" not in cases.prod_spec("ddtree16-fp32").env
    assert cases.prod_spec("dflash-dense8b-eager").algorithm == "DFLASH"


def test_prod_switches_come_in_any_order_and_unknown_ones_are_refused():
    spec = cases.prod_spec("ddtree15-fp32-cf-reuse")
    assert spec.env == {"SGLANG_DDTREE_GDN_REUSE_PARENT": "1"}
    assert spec.overrides["speculative-ddtree-counterfactual-fraction"] == 0.05
    assert spec.overrides["mamba-ssm-dtype"] == "float32" and spec.overrides["mem-fraction-static"] == 0.88
    plain = cases.prod_spec("ddtree15-bf16-reuse")
    assert "speculative-ddtree-counterfactual-fraction" not in plain.overrides
    with pytest.raises(ValueError, match="unknown switch -fast"):
        cases.prod_spec("ddtree15-fp32-fast")


def test_prod_specs_name_the_decoder_and_the_ssm_dtype():
    spec = cases.prod_spec("ddtree32-bf16")
    assert spec.algorithm == "DDTREE" and spec.overrides["speculative-ddtree-budget"] == 32
    assert spec.overrides["mamba-ssm-dtype"] == "bfloat16" and "dummy" in spec.extra
    assert cases.prod_spec("plain-fp32").algorithm is None
    for bad in ("dflash", "ddtreeX-fp32", "eagle-fp32", "dflash-fp16"):
        with pytest.raises(ValueError, match=bad):
            cases.prod_spec(bad)


def test_prod_and_bench_specs_take_adaptive_widths(monkeypatch):
    assert cases.prod_spec("ddtreeauto-fp32").overrides["speculative-ddtree-budget"] == "auto"
    assert cases.prod_spec("ddtree15x31-dense8b").overrides["speculative-ddtree-budget"] == "15,31"
    monkeypatch.setenv("DDTREE_GPU_LAB_BUDGETS", "16 auto 15,31")
    monkeypatch.setenv("DDTREE_GPU_LAB_PAIRS", "hybrid")
    budgets = {s.name: s.overrides.get("speculative-ddtree-budget") for s in cases.bench_specs()}
    assert budgets["hybrid-ddtree-b16"] == 16 and budgets["hybrid-ddtree-bauto"] == "auto"
    assert budgets["hybrid-ddtree-b15,31"] == "15,31"
    env = {s.name: s.env for s in cases.bench_specs()}
    assert env["hybrid-ddtree-bauto"] == {"SGLANG_DDTREE_WIDTH_GRAPHS": "1"} and not env["hybrid-ddtree-b16"]


def test_the_label_counted_is_the_one_sglang_writes():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.utils.profile_utils import build_step_span_name

    batch = types.SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=3)
    verify = build_step_span_name(batch, detailed_annotations=False)
    draft = build_step_span_name(batch, detailed_annotations=False, is_draft_worker=True)
    assert profile_gaps.STEP.match(verify).groups() == ("VERIFY", "3")
    assert profile_gaps.STEP.match(draft).groups() == ("DRAFT", "3")


def _x(cat, name, ts, dur, **extra):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 7, **extra}


def test_the_analysis_gives_time_idle_and_syncs_per_round(tmp_path):
    # Three verifies 10 ms apart: two rounds (counted on the host: the GPU has two spans per
    # verify, one per stream). Per round: verify kernels 4 ms, draft 2 ms, so 4 ms
    # idle; one stream sync issued from the plugin's tree round, one device-to-host copy.
    events = []
    tree_round = "ddtree_runtime/sglang_plugin/round/tree_round.py(120): run_tree_round"
    for r in range(3):
        t = r * 10_000
        events += [
            _x("user_annotation", "step[VERIFY bs=1]", t, 4_000),
            _x("gpu_user_annotation", "step[VERIFY bs=1]", t, 4_000),
            # the profiler's second GPU span of the same forward (another stream), inside the first
            _x("gpu_user_annotation", "step[VERIFY bs=1]", t + 1_000, 2_000, tid=8),
            _x("kernel", "verify_gemm", t, 4_000),
            _x("gpu_user_annotation", "step[DRAFT bs=1]", t + 5_000, 2_000),
            _x("kernel", "draft_gemm", t + 5_000, 2_000),
            _x("python_function", tree_round, t + 7_000, 2_500),
            _x("python_function", "torch/_tensor.py(50): tolist", t + 7_100, 2_000),
            _x("cuda_runtime", "cudaStreamSynchronize", t + 7_200, 900),
            _x("cuda_runtime", "cudaMemcpyAsync", t + 8_500, 100, args={"correlation": 1000 + r}),
            _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", t + 8_600, 10, args={"correlation": 1000 + r}),
            _x("cuda_runtime", "cudaMemcpyAsync", t + 9_000, 100, args={"correlation": 2000 + r}),
            _x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", t + 9_100, 10, args={"correlation": 2000 + r}),
        ]  # fmt: skip
    path = tmp_path / "x.trace.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    report = profile_gaps.analyse(path)
    assert report["rounds"] == 2
    assert report["round_ms"] == 10.0
    assert report["gpu_ms_per_round"] == {"VERIFY": 4.0, "DRAFT": 2.0}
    assert report["gpu_idle_per_round_ms"] == pytest.approx(4.0 - 0.02, abs=1e-6)
    assert report["host_syncs_per_round"] == 1 and report["dtoh_copies_per_round"] == 1
    assert report["sync_sites_per_round"][f"cudaStreamSynchronize @ {tree_round}"] == 1


def test_a_trace_without_two_verifies_says_so(tmp_path):
    path = tmp_path / "empty.trace.json"
    path.write_text(json.dumps({"traceEvents": [_x("kernel", "k", 0, 5)]}))
    assert "0 verify spans" in profile_gaps.analyse(Path(path))["error"]


def test_the_analysis_splits_each_stage_by_kernel_family_and_name(tmp_path):
    # Two rounds of 10 ms. Per round: the verify's GEMM 3 ms, its tree-masked attention 0.5 ms and a
    # GDN recurrent kernel 0.4 ms; the drafter's GEMM 1.5 ms; between them the tree build 0.2 ms and
    # a device-to-host copy (a memcpy, not a kernel).
    events = []
    for r in range(3):
        t = r * 10_000
        events += [
            _x("user_annotation", "step[VERIFY bs=1]", t, 4_000),
            _x("gpu_user_annotation", "step[VERIFY bs=1]", t, 4_000),
            _x("kernel", "nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_TNT", t, 3_000),
            _x("kernel", "_fwd_kernel", t + 3_000, 500),
            _x("kernel", "fused_recurrent_gated_delta_rule_fwd_kernel", t + 3_500, 400),
            _x("gpu_user_annotation", "step[DRAFT bs=1]", t + 5_000, 2_000),
            _x("kernel", "nvjet_hsh_64x8_64x16_4x1_v_bz_TNN", t + 5_000, 1_500),
            _x("kernel", "_build_kernel", t + 7_500, 200),
            _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", t + 8_000, 10),
        ]  # fmt: skip
    path = tmp_path / "k.trace.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    kernels = profile_gaps.analyse(path)["kernels_per_round"]
    assert set(kernels) == {"VERIFY", "DRAFT", "between"}
    assert kernels["VERIFY"]["families_ms"] == {"gemm": 3.0, "attention": 0.5, "gdn": 0.4}
    assert kernels["VERIFY"]["kernel_ms"] == pytest.approx(3.9)
    assert kernels["DRAFT"]["families_ms"] == {"gemm": 1.5}
    assert kernels["between"]["families_ms"] == {"tree": 0.2, "memcpy": 0.01}
    top = kernels["VERIFY"]["top_kernels"][0]
    assert top["name"].startswith("nvjet_hsh_128x256") and (top["ms"], top["calls"]) == (3.0, 1.0)


@pytest.mark.parametrize(
    ("name", "family"),
    [
        ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "gdn"),
        ("_causal_conv1d_update_kernel", "gdn"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("_fwd_kernel_stage1", "attention"),
        ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", "topk_sort"),
        ("rmsnorm_kernel", "norm"),
        ("_walk_kernel", "tree"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<long>>", "elementwise"),
        ("mystery", "other"),
    ],
)
def test_kernel_families_by_name(name, family):
    assert profile_gaps.kernel_family(name) == family


def test_the_prices_switch_asks_for_the_table_and_the_case_reports_it():
    spec = cases.prod_spec("ddtree15-fp32-prices-reuse")
    assert cases.PRICE_FLAG in spec.extra and spec.extra[:2] == ["--load-format", "dummy"]
    assert cases.PRICE_FLAG not in cases.prod_spec("ddtree15-fp32-reuse").extra
    table = {"unit": "seconds", "method": "graphs", "repeats": 5, "measure_s": 0.2,
             "entries": [{"width": "15", "batch_size": 1, "verify_s": 0.021, "rest_s": 0.003}]}  # fmt: skip

    class Server:
        def __init__(self, status, info):
            self.answer = (status, info)

        def request(self, path):
            assert path == "/server_info"
            return self.answer

    got = cases._prices(Server(200, {"internal_states": [{}, {"ddtree_prices": table}]}))
    assert got["prices"]["entries"][0]["verify_s"] == 0.021
    assert "no price table" in cases._prices(Server(200, {"internal_states": [{}]}))["error"]
    assert "no price table" in cases._prices(Server(503, "starting"))["error"]
    bad = {**table, "entries": [{"width": "15", "batch_size": 1, "verify_s": -1.0, "rest_s": 0.003}]}
    assert "verify_s" in cases._prices(Server(200, {"internal_states": [{"ddtree_prices": bad}]}))["error"]
