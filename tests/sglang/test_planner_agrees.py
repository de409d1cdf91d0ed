"""The memory planner against SGLang 0.5.23's own sizing code, run on CPU on the same configs.

SGLang resolves the launch flags (its real parser and resolution pipeline, with the DDTREE plugin
loaded), builds its real ``KVCacheConfigurator`` for the target and runs the start-up sizing chain
(``_profile_available_bytes`` -> ``_handle_max_mamba_cache`` -> ``config_from_budget`` ->
``resolve_max_num_reqs``) from the same memory figures the planner is given. Only the two device
queries are answered by the test: the free memory after the weights are loaded, and (for the
GPU-size defaults) the device capacity. Everything runs in a scoped SGLang context
(``create_context``/``use_context``), so no other test sees it.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ddtree_runtime.planner import load_model_pair, plan_memory
from ddtree_runtime.planner.accounting import CONTEXT_GIB, CONTEXT_GIB_TP, GIB
from ddtree_runtime.planner.gpus import GpuFacts
from ddtree_runtime.planner.settings import from_flags, graph_reserve_mib, resolve
from tests.fixtures_models import write_full_checkpoint_pair

pytestmark = pytest.mark.sglang

H200_MIB, A6000_MIB = 143771, 49140


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("planner-pairs")
    return {"hybrid": write_full_checkpoint_pair(root, "qwen3.6-27b", shards=3),
            "dense": write_full_checkpoint_pair(root, "qwen3-8b", shards=2)}


def _argv(target: Path, draft: Path, flags: dict[str, Any]) -> list[str]:
    argv = ["--model-path", str(target), "--speculative-algorithm", "DDTREE",
            "--speculative-draft-model-path", str(draft), "--device", "cuda"]
    for name, value in flags.items():
        argv += [f"--{name}"] if value is True else [f"--{name}", str(value)]
    return argv


class SGLangSizing:
    """One resolved SGLang configuration, its scoped context and its KVCacheConfigurator."""

    def __init__(self, sglang_plugins: Any, target: Path, draft: Path, flags: dict[str, Any],
                 monkeypatch: pytest.MonkeyPatch, gpu_mem_mib: float | None = None) -> None:
        import sglang.srt.arg_groups.memory_hook as memory_hook
        import torch
        from sglang.srt import runtime_context as rc
        from sglang.srt.arg_groups.model_override_base import model_config_of
        from sglang.srt.arg_groups.overrides import resolving_view
        from sglang.srt.configs.draft_parallel import DraftParallelLayout
        from sglang.srt.mem_cache import kv_cache_configurator as kvc_module
        from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
        from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
            resolve_spec_aux_hidden_state_config,
        )
        from sglang.srt.server_args import prepare_server_args

        self._kvc_module = kvc_module
        self._monkeypatch = monkeypatch
        # SGLang answers these two from the device; the planner's figures stand in for them.
        monkeypatch.setattr(memory_hook, "get_device_memory_capacity", lambda device=None: gpu_mem_mib)
        self._platform = rc.override_platform(is_cuda=True)  # DFLASH-family and extra_buffer want CUDA
        self._platform.install()
        record = prepare_server_args(_argv(target, draft, flags))
        record.resolve_once()
        self.record = record
        self.cfg = resolving_view(record)
        self.context = rc.create_context(record, role="scheduler")
        with rc.use_context(self.context):
            rc.get_parallel().override_permanently(world_group=SimpleNamespace(cpu_group=None))
            self.model_config = model_config_of(record)
            algo = sglang_plugins.from_string("DDTREE")
            aux = resolve_spec_aux_hidden_state_config(
                server_args=record, model_config=self.model_config, spec_algorithm=algo, is_draft_worker=False
            )
            layers = self.model_config.num_hidden_layers
            self.kvc = kvc_module.KVCacheConfigurator(
                device="cuda", gpu_id=0, attn_dp_size=1, pp_size=1, pp_group=None, model=None,
                model_config=self.model_config, server_args=record, kv_cache_dtype=torch.bfloat16,
                kv_cache_dtype_str="auto", model_dtype=torch.bfloat16, page_size=1, sliding_window_size=None,
                spec_algorithm=algo, is_draft_worker=False, post_capture_kv_active=False, spec_aux_config=aux,
                draft_parallel_layout=DraftParallelLayout(tp_group=None, attn_tp_size=self.cfg.tp_size),
                is_hybrid_swa=False, is_hybrid_swa_compress=False, use_mla_backend=False,
                layer_info=ModelLayerInfo(start_layer=0, end_layer=layers, num_effective_layers=layers),
                forward_stream=None, req_to_token_pool=None, token_to_kv_pool_allocator=None,
                memory_pool_config=None,
            )

    def close(self) -> None:
        self._platform.restore()

    def mamba_cache_per_req(self) -> int | None:
        from sglang.srt import runtime_context as rc

        with rc.use_context(self.context):
            mamba = self.kvc.mambaish_config
            return None if mamba is None else mamba.mamba2_cache_params.mamba_cache_per_req

    def cell_size(self) -> int:
        from sglang.srt import runtime_context as rc
        from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator

        with rc.use_context(self.context):
            return create_memory_pool_configurator(self.kvc)._cell_size

    def startup(self, pre_gib: float, weights_gib: float) -> tuple[int, int, int | None]:
        """SGLang's sizing chain: (max_total_num_tokens, max_running_requests, max_mamba_cache_size)."""
        from sglang.srt import runtime_context as rc

        self._monkeypatch.setattr(self._kvc_module, "get_available_gpu_memory",
                                  lambda *a, **k: pre_gib - weights_gib)
        with rc.use_context(self.context):
            budget = self.kvc._profile_available_bytes(pre_gib)
            config = self.kvc.config_from_budget(budget)
            running = self.kvc.resolve_max_num_reqs(config.max_total_num_tokens)
            slots = rc.get_schedule().max_mamba_cache_size if self.kvc.mambaish_config is not None else None
            return config.max_total_num_tokens, running, slots


@pytest.fixture
def sizing(sglang_plugins, monkeypatch):
    """SGLang configurations for one test; SGLang's resolution writes some flags into the environment
    (--mamba-ssm-dtype becomes SGLANG_MAMBA_SSM_DTYPE), so the environment is restored afterwards."""
    made: list[SGLangSizing] = []
    saved = dict(os.environ)

    def make(target: Path, draft: Path, flags: dict[str, Any], gpu_mem_mib: float | None = None):
        s = SGLangSizing(sglang_plugins, target, draft, flags, monkeypatch, gpu_mem_mib)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()
    os.environ.clear()
    os.environ.update(saved)


HYBRID = {"mamba-radix-cache-strategy": "extra_buffer"}
CASES = [
    # name, pair, flags, free GiB per GPU
    ("hybrid balanced (mamba cache pinned, caps running requests)", "hybrid",
     {**HYBRID, "mem-fraction-static": 0.85, "context-length": 32768, "max-running-requests": 32,
      "mamba-ssm-dtype": "float32", "max-mamba-cache-size": 64, "speculative-ddtree-budget": 16}, 140.4),
    ("hybrid balanced, overlap scheduler off (4 state slots per request)", "hybrid",
     {**HYBRID, "mem-fraction-static": 0.85, "context-length": 32768, "max-running-requests": 32,
      "mamba-ssm-dtype": "float32", "max-mamba-cache-size": 64, "speculative-ddtree-budget": 16,
      "disable-overlap-schedule": True}, 140.4),
    ("hybrid tp2, bf16 state, budget under the block", "hybrid",
     {**HYBRID, "tp-size": 2, "mem-fraction-static": 0.85, "context-length": 32768, "max-running-requests": 8,
      "mamba-ssm-dtype": "bfloat16", "max-mamba-cache-size": 32, "speculative-ddtree-budget": 8}, 47.99),
    ("hybrid, mamba cache sized by SGLang (joint solve)", "hybrid",
     {**HYBRID, "mem-fraction-static": 0.8, "context-length": 65536, "max-running-requests": 24,
      "speculative-ddtree-budget": 32}, 140.4),
    ("hybrid, no radix cache, no_buffer", "hybrid",
     {"disable-radix-cache": True, "mem-fraction-static": 0.88,
      "max-running-requests": 12, "speculative-ddtree-budget": 24}, 140.4),
    ("dense", "dense",
     {"mem-fraction-static": 0.8, "context-length": 40960, "max-running-requests": 64}, 79.6),
    ("dense tp2", "dense",
     {"tp-size": 2, "mem-fraction-static": 0.85, "speculative-ddtree-budget": 31}, 47.99),
    # adaptive widths: SGLang reserves, and the plan counts, the widest width's rows
    ("hybrid auto widths (15,31)", "hybrid",
     {**HYBRID, "mem-fraction-static": 0.85, "context-length": 32768, "max-running-requests": 16,
      "mamba-ssm-dtype": "bfloat16", "max-mamba-cache-size": 32, "speculative-ddtree-budget": "auto"}, 140.4),
    ("dense widths 7,15,31", "dense",
     {"mem-fraction-static": 0.8, "context-length": 40960, "speculative-ddtree-budget": "7,15,31"}, 79.6),
]


@pytest.mark.parametrize(("name", "which", "flags", "free_gib"), CASES, ids=[c[0] for c in CASES])
def test_planner_matches_sglang_sizing(sizing, pairs, name, which, flags, free_gib):
    target, draft = pairs[which]
    sg = sizing(target, draft, flags)
    pair = load_model_pair(target, draft)
    settings = from_flags(flags)
    tp = settings.tp_size
    gpus = [GpuFacts(i, "GPU", int(free_gib * 1024) + 1, int(free_gib * 1024)) for i in range(tp)]
    plan = plan_memory(pair, gpus, settings)
    r = plan.resolved
    cfg = sg.cfg

    # resolution: widths, defaults, scheduler and mamba strategy as SGLang (+ the plugin) resolve them
    assert r.draft_tokens == cfg.speculative_num_draft_tokens
    assert r.requested_running == cfg.max_running_requests
    assert r.overlap == (not cfg.disable_overlap_schedule)
    assert r.context_length == sg.model_config.context_len
    if pair.target.hybrid and not flags.get("disable-radix-cache"):
        assert r.radix_strategy == cfg.mamba_radix_cache_strategy
    from sglang.srt import runtime_context as rc

    with rc.use_context(sg.context):
        if pair.target.hybrid:
            assert r.mamba_ratio == sg.kvc._calculate_mamba_ratio()
    # per-slot recurrent state and per-token KV bytes: SGLang's own properties
    per_req = sg.mamba_cache_per_req()
    if pair.target.hybrid:
        ssm_bytes = {"float32": 4, "bfloat16": 2}[r.ssm_dtype]
        assert pair.target.linear.state_bytes_per_slot(tp, ssm_bytes=ssm_bytes) == per_req
    else:
        assert per_req is None
    kv = plan.term("kv_cache")
    cell = sg.cell_size()
    assert pair.target.kv_bytes_per_token(tp, 2) + pair.draft.kv_bytes_per_token(tp, 2) == cell
    assert f"{cell / 1024:.1f} KiB" in kv.detail

    # the start-up chain from the same figures: KV tokens, running requests, state slots
    pre = plan.term("pre_load").gib
    assert pre == pytest.approx(free_gib - CONTEXT_GIB.get(tp, CONTEXT_GIB_TP), abs=1e-3)
    weights = plan.term("target_weights").gib + plan.term("draft_weights").gib
    tokens, running, slots = sg.startup(pre, weights)
    assert plan.verdict.status in ("fits", "smaller_context"), plan.verdict
    assert plan.token_capacity == tokens
    assert plan.running_requests == running
    if pair.target.hybrid:
        assert plan.mamba_slots == slots


def test_planner_finds_the_hybrid_state_failure_sglang_raises(sizing, pairs):
    """A budget whose scratch outgrows the pool: SGLang's own check refuses, and so does the plan."""
    target, draft = pairs["hybrid"]
    flags = {**HYBRID, "mem-fraction-static": 0.85, "max-running-requests": 32, "max-mamba-cache-size": 128,
             "mamba-ssm-dtype": "float32", "speculative-ddtree-budget": 64}
    sg = sizing(target, draft, flags)
    pair = load_model_pair(target, draft)
    settings = from_flags(flags)
    plan = plan_memory(pair, [GpuFacts(0, "NVIDIA H200", H200_MIB, H200_MIB)], settings)
    assert plan.verdict.status == "does_not_fit" and plan.verdict.term == "speculative_scratch"
    pre = plan.term("pre_load").gib
    weights = plan.term("target_weights").gib + plan.term("draft_weights").gib
    with pytest.raises((RuntimeError, ValueError), match=r"Loaded weights leave no GPU|Not enough GPU"):
        sg.startup(pre, weights)


@pytest.mark.parametrize("gpu_mem_mib", [H200_MIB, A6000_MIB], ids=["H200", "A6000"])
@pytest.mark.parametrize("which", ["hybrid", "dense"])
def test_gpu_size_defaults_and_auto_fraction_match_sglang(sizing, pairs, gpu_mem_mib, which):
    """Without --mem-fraction-static SGLang picks one from the GPU size (handle_gpu_memory_settings)."""
    target, draft = pairs[which]
    flags = {**(HYBRID if which == "hybrid" else {}), "max-running-requests": 16}
    sg = sizing(target, draft, flags, gpu_mem_mib=gpu_mem_mib)
    pair = load_model_pair(target, draft)
    settings = from_flags(flags)
    r = resolve(settings, pair, gpu_mem_mib)
    cfg = sg.cfg
    assert r.chunked_prefill_size == cfg.chunked_prefill_size
    assert r.cuda_graph_max_bs == cfg.cuda_graph_config.decode.max_bs
    assert cfg.cuda_graph_config.prefill.backend == "disabled"  # the reserve counts decode graphs only
    assert r.mem_fraction_auto and r.mem_fraction_static == pytest.approx(cfg.mem_fraction_static, abs=1e-9)
    # the graph part of the reserve is SGLang's reserve_for_graph_mb
    from sglang.srt.arg_groups.memory_hook import reserve_for_graph_mb

    assert graph_reserve_mib(r) == pytest.approx(reserve_for_graph_mb(sg.record))


def test_weights_are_what_the_headers_say(pairs):
    """27B in bf16 from the headers: MTP not loaded, the vision tower loaded (ConditionalGeneration)."""
    pair = load_model_pair(*pairs["hybrid"])
    w = pair.target.weights
    assert w.skipped == ("mtp",)
    assert 50.5 * GIB < w.total < 51.5 * GIB  # ~54.7 GB: the language model and the vision tower
    assert (w.total + w.skipped_bytes) / 1e9 == pytest.approx(55.6, abs=0.2)  # hybrid-verify.md's figure
