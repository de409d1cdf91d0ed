"""The GDN tree-verify recurrence that keeps a parent's state in registers
(``core/kernels/gdn_tree_recurrent.py``) against SGLang 0.5.23's own kernel, bit for bit: outputs and
every scratch row, fp32 and bf16 state, our trees in heap order and in an order where every row's
parent is the previous row (the chain), several requests with padding rows. On the CPU both run in
Triton's interpreter; ``tests/gpu/`` compares them compiled."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.sglang

H, HV, K, V = 2, 4, 16, 16  # small heads: the interpreter runs every program in Python


def _verify_inputs(batch: int, rows: int, parents: torch.Tensor, ssm_dtype: torch.dtype, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = batch * rows
    slots = batch + 2
    return {
        "A_log": torch.randn(HV, generator=g) * 0.5,
        "a": torch.randn(n, HV, generator=g),
        "dt_bias": torch.randn(HV, generator=g) * 0.5,
        "softplus_beta": 1.0,
        "softplus_threshold": 20.0,
        "q": torch.randn(1, n, H, K, generator=g),
        "k": torch.randn(1, n, H, K, generator=g),
        "v": torch.randn(1, n, HV, V, generator=g),
        "b": torch.randn(n, HV, generator=g),
        "initial_state_source": (torch.randn(slots, HV, V, K, generator=g) * 0.3).to(ssm_dtype),
        # requests in scattered pool slots; the scratch rows are per request
        "initial_state_indices": torch.arange(batch, dtype=torch.int32).flip(0) + 1,
        "cu_seqlens": torch.arange(0, (batch + 1) * rows, rows, dtype=torch.int32),
        "intermediate_states_buffer": torch.zeros(slots, rows, HV, V, K, dtype=ssm_dtype),
        "intermediate_state_indices": torch.arange(batch, dtype=torch.int32),
        # padding rows point at the root here (the server leaves them stale; both kernels read the same)
        "retrieve_parent_token": parents.clamp(min=0).to(torch.int32),
    }


def _tree_parents(batch: int, budget: int, seed: int) -> torch.Tensor:
    from ddtree_runtime.core.tree import build_tree

    g = torch.Generator().manual_seed(seed)
    tree = build_tree(torch.randn(batch, 6, 40, generator=g) * 3.0, budget)
    return tree.parents  # [b, budget + 1]; row 0 the root (-1)


def _sglang(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    from sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent import (
        fused_sigmoid_gating_delta_rule_update,
    )

    args = {key: (val.clone() if isinstance(val, torch.Tensor) else val) for key, val in inputs.items()}
    rows = args["intermediate_states_buffer"].shape[1]
    out = fused_sigmoid_gating_delta_rule_update(
        **args, use_qk_l2norm_in_kernel=True, is_kda=False, disable_state_update=True, cache_steps=rows
    )
    return out, args["intermediate_states_buffer"]


def _ours(inputs: dict, *, reuse_parent: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    from ddtree_runtime.core.kernels.gdn_tree_recurrent import gdn_tree_verify

    args = {key: (val.clone() if isinstance(val, torch.Tensor) else val) for key, val in inputs.items()}
    out = gdn_tree_verify(**args, block_v=4, num_warps=1, reuse_parent=reuse_parent)
    return out, args["intermediate_states_buffer"]


@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", ["tree", "chain"])
def test_the_parent_reusing_recurrence_is_bit_identical_to_sglangs(ssm_dtype, shape) -> None:
    from ddtree_runtime.core.kernels.gdn_tree_recurrent import parent_is_previous_fraction

    batch, budget = 3, 7
    if shape == "tree":
        parents = _tree_parents(batch, budget, seed=1)
    else:  # every row's parent is the row before it: every reload is skipped
        parents = torch.arange(-1, budget).expand(batch, -1).clone()
    parents[2, 5:] = -1  # a request with padding rows (fewer nodes than the budget)
    reuse = parent_is_previous_fraction(parents)
    assert 0.0 < reuse <= 1.0 and (shape == "tree") == (reuse < 1.0), reuse
    inputs = _verify_inputs(batch, budget + 1, parents, ssm_dtype, seed=2)
    want_out, want_scratch = _sglang(inputs)
    got_out, got_scratch = _ours(inputs)
    assert torch.equal(got_out, want_out)
    assert torch.equal(got_scratch, want_scratch)
    assert want_scratch[:batch].abs().sum() > 0  # the scratch rows were written, not left at zero


def test_a_wrong_reused_state_is_caught() -> None:
    """The comparison above can fail: a kernel that always keeps the previous row's state (ignoring
    the parents) differs from SGLang's on a tree."""
    batch, budget = 2, 7
    parents = _tree_parents(batch, budget, seed=3)
    chain = torch.arange(-1, budget).expand(batch, -1).clone()
    inputs = _verify_inputs(batch, budget + 1, parents, torch.float32, seed=4)
    wrong = dict(inputs, retrieve_parent_token=chain.to(torch.int32))
    want_out, _ = _sglang(inputs)
    got_out, _ = _ours(wrong)
    assert not torch.equal(got_out, want_out)


def test_the_fraction_counts_only_real_rows() -> None:
    from ddtree_runtime.core.kernels.gdn_tree_recurrent import parent_is_previous_fraction

    parents = torch.tensor([[-1, 0, 1, 1, 0, -1], [-1, 0, 0, 0, -1, -1]])
    # request 0: rows 1 (parent 0) and 2 (parent 1) follow their parent; 3 and 4 do not; row 5 is padding
    # request 1: row 1 follows; rows 2, 3 do not
    assert parent_is_previous_fraction(parents) == pytest.approx(3 / 7)


# The SGLang code the plugin's recurrence reproduces and hooks: an upgrade that changes them must be
# re-audited (the kernel's arithmetic, the launch choice, the one call site's keyword arguments).
GDN_SEAMS = [
    ("sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent.fused_sigmoid_gating_delta_rule_update_kernel",
     ["b_h = tl.load(cache_ptr, mask=mask_h, other=0).to(tl.float32)",
      "tl.store(cache_ptr, b_h.to(cache_ptr.dtype.element_ty), mask=mask_h)"], "9988bfb6019565e7"),
    ("sglang.srt.layers.attention.linear.kernels.gdn_triton.TritonGDNKernel.target_verify",
     ["retrieve_parent_token=retrieve_parent_token,", "use_qk_l2norm_in_kernel=True,"], "629947a0db4b0be3"),
    ("sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent.fused_sigmoid_gating_delta_rule_update",
     ["cache_stride_steps = intermediate_states_buffer.stride(0) // (HV * K * V)"], "f66af14f8c40efaa"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "snippets", "digest"), GDN_SEAMS, ids=["kernel", "target_verify", "launcher"]
)
def test_the_gdn_seam_is_what_the_plugin_was_written_against(path, snippets, digest) -> None:
    import hashlib
    import inspect
    import pkgutil

    module, _, attr = path.rpartition(".")
    obj = getattr(pkgutil.resolve_name(module), attr)
    source = inspect.getsource(getattr(obj, "fn", obj))  # a Triton kernel's Python function
    for snippet in snippets:
        assert snippet in source, f"{path} no longer contains {snippet!r}: re-audit gdn_tree_recurrent"
    got = hashlib.sha256(source.encode()).hexdigest()[:16]
    assert got == digest, f"{path} changed (sha256 {got}): re-audit gdn_tree_recurrent, then update GDN_SEAMS"


def _target_verify_kwargs(batch: int, budget: int, seed: int) -> dict:
    """What ``GDNAttnBackend`` passes ``TritonGDNKernel.target_verify`` for a tree verify."""
    parents = _tree_parents(batch, budget, seed)
    inputs = _verify_inputs(batch, budget + 1, parents, torch.float32, seed)
    return {
        "A_log": inputs["A_log"], "dt_bias": inputs["dt_bias"], "q": inputs["q"], "k": inputs["k"],
        "v": inputs["v"], "a": inputs["a"], "b": inputs["b"], "ssm_states": inputs["initial_state_source"],
        "cache_indices": inputs["initial_state_indices"], "query_start_loc": inputs["cu_seqlens"],
        "intermediate_states_buffer": inputs["intermediate_states_buffer"],
        "intermediate_state_indices": inputs["intermediate_state_indices"], "cache_steps": budget + 1,
        "retrieve_parent_token": inputs["retrieve_parent_token"], "stable_rows": False,
    }  # fmt: skip


def test_the_hooks_tree_call_is_bit_identical_to_sglangs_target_verify(monkeypatch) -> None:
    from sglang.kernels.ops.attention.linear import fused_sigmoid_gating_recurrent as fused
    from sglang.srt.layers.attention.linear.kernels import gdn_triton

    from ddtree_runtime.sglang_plugin.gdn_verify_kernel import plugin_target_verify

    # SGLang's module imports its kernel only off the CPU; the interpreter runs it here.
    monkeypatch.setattr(gdn_triton, "fused_sigmoid_gating_delta_rule_update",
                        fused.fused_sigmoid_gating_delta_rule_update, raising=False)  # fmt: skip
    kwargs = _target_verify_kwargs(batch=2, budget=7, seed=5)
    theirs = {key: (val.clone() if isinstance(val, torch.Tensor) else val) for key, val in kwargs.items()}
    ours = {key: (val.clone() if isinstance(val, torch.Tensor) else val) for key, val in kwargs.items()}
    want = gdn_triton.TritonGDNKernel().target_verify(**theirs)
    got = plugin_target_verify(**ours)
    assert got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(ours["intermediate_states_buffer"], theirs["intermediate_states_buffer"])


def test_the_hook_leaves_chains_and_the_cpu_to_sglang() -> None:
    from ddtree_runtime.sglang_plugin.gdn_verify_kernel import gdn_target_verify_hook

    calls = []

    def original(kernel, *args, **kwargs):
        calls.append(kwargs.get("retrieve_parent_token"))
        return "sglang"

    kwargs = _target_verify_kwargs(batch=1, budget=3, seed=6)
    assert gdn_target_verify_hook(original, object(), **kwargs) == "sglang"  # CPU tensors
    assert gdn_target_verify_hook(original, object(), **dict(kwargs, retrieve_parent_token=None)) == "sglang"
    assert len(calls) == 2


def test_the_hook_is_registered_only_with_the_switch_on(monkeypatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    from ddtree_runtime.sglang_plugin import gdn_verify_kernel

    registered = []
    monkeypatch.setattr(HookRegistry, "register", classmethod(lambda cls, *a, **k: registered.append(a[0])))
    monkeypatch.delenv(gdn_verify_kernel.SWITCH, raising=False)
    assert gdn_verify_kernel.register_gdn_verify_hook() is False and registered == []
    monkeypatch.setenv(gdn_verify_kernel.SWITCH, "1")
    assert gdn_verify_kernel.register_gdn_verify_hook() is True
    assert registered == [gdn_verify_kernel.TARGET_VERIFY]
