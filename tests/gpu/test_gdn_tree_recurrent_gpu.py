"""The plugin's GDN tree-verify recurrence (``core/kernels/gdn_tree_recurrent.py``) compiled on the GPU
against SGLang 0.5.23's kernel at Qwen3.6-27B's GDN head shape: outputs and every scratch row bit for
bit, fp32 and bf16 state, 1 and 8 requests, our trees in heap order and depth first, through the
plugin's hook (``sglang_plugin.gdn_verify_kernel.plugin_target_verify``) with SGLang's launch choice."""

from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")
H, HV, K, V = 16, 48, 128, 128  # Qwen3.6-27B's GDN heads at TP 1


def _parents(batch: int, budget: int, preorder: bool) -> torch.Tensor:
    from ddtree_runtime.core.tree import build_tree
    from ddtree_runtime.core.tree_order import depth_first_order, reorder_tree

    g = torch.Generator().manual_seed(batch + budget)
    tree = build_tree(torch.randn(batch, 15, 1000, generator=g) * 5.0, budget)
    if preorder:
        tree = reorder_tree(tree, depth_first_order(tree.parents))
    return tree.parents


def _kwargs(batch: int, budget: int, ssm_dtype: torch.dtype, preorder: bool) -> dict:
    gen = torch.Generator(device=DEV).manual_seed(7)
    rows = budget + 1
    n = batch * rows
    slots = batch + 3
    return {
        "A_log": torch.randn(HV, device=DEV, generator=gen) * 0.5,
        "dt_bias": torch.randn(HV, device=DEV, generator=gen) * 0.5,
        "q": torch.randn(1, n, H, K, device=DEV, generator=gen, dtype=torch.bfloat16),
        "k": torch.randn(1, n, H, K, device=DEV, generator=gen, dtype=torch.bfloat16),
        "v": torch.randn(1, n, HV, V, device=DEV, generator=gen, dtype=torch.bfloat16),
        "a": torch.randn(n, HV, device=DEV, generator=gen, dtype=torch.bfloat16),
        "b": torch.randn(n, HV, device=DEV, generator=gen, dtype=torch.bfloat16),
        "ssm_states": (torch.randn(slots, HV, V, K, device=DEV, generator=gen) * 0.1).to(ssm_dtype),
        "cache_indices": torch.arange(batch, dtype=torch.int32, device=DEV).flip(0) + 2,
        "query_start_loc": torch.arange(0, (batch + 1) * rows, rows, dtype=torch.int32, device=DEV),
        "intermediate_states_buffer": torch.zeros(slots, rows, HV, V, K, dtype=ssm_dtype, device=DEV),
        "intermediate_state_indices": torch.arange(batch, dtype=torch.int32, device=DEV),
        "cache_steps": rows,
        "retrieve_parent_token": _parents(batch, budget, preorder).clamp(min=0).to(torch.int32).to(DEV),
    }


@pytest.mark.parametrize("preorder", [False, True], ids=["heap", "preorder"])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_plugins_gdn_tree_verify_is_bit_identical_to_sglangs_on_the_gpu(ssm_dtype, batch, preorder):
    # Importing SGLang imports transformers, which loads torchvision when it is installed; the device
    # image's torchvision aborted this process when its C extension loaded (H100, 2026-12-05). The
    # kernels need neither: hide it (find_spec then answers None). Here, on a GPU only: done at import
    # it hid a working torchvision from every CPU test of the same pytest process.
    if "torchvision" not in sys.modules:
        sys.modules["torchvision"] = None  # type: ignore[assignment]
    from sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent import (
        fused_sigmoid_gating_delta_rule_update,
    )

    from ddtree_runtime.sglang_plugin.gdn_verify_kernel import plugin_target_verify

    kwargs = _kwargs(batch, 15, ssm_dtype, preorder)
    theirs = {key: (val.clone() if isinstance(val, torch.Tensor) else val) for key, val in kwargs.items()}
    want = fused_sigmoid_gating_delta_rule_update(
        A_log=theirs["A_log"], dt_bias=theirs["dt_bias"], q=theirs["q"], k=theirs["k"], v=theirs["v"],
        a=theirs["a"], b=theirs["b"], initial_state_source=theirs["ssm_states"],
        initial_state_indices=theirs["cache_indices"], cu_seqlens=theirs["query_start_loc"],
        use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0, is_kda=False,
        disable_state_update=True, intermediate_states_buffer=theirs["intermediate_states_buffer"],
        intermediate_state_indices=theirs["intermediate_state_indices"], cache_steps=theirs["cache_steps"],
        retrieve_parent_token=theirs["retrieve_parent_token"],
    )  # fmt: skip
    got = plugin_target_verify(**kwargs)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert torch.equal(kwargs["intermediate_states_buffer"], theirs["intermediate_states_buffer"])
