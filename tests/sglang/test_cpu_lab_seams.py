"""The lab CPU layer (scripts/lab/sglang-cpu-lab/) against the installed SGLang wheel.

Every work-around relies on SGLang 0.5.23 code by name and by content (``seams.SEAMS``): these tests fail
when the wheel moves one of them, and check each replacement op against SGLang's own kernel for the same
job. The layer must stay inert unless a lab CPU host switches it on.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import subprocess
import sys

import pytest
import torch

seams = pytest.importorskip("ddtree_sglang_cpu_lab.seams")
standin = pytest.importorskip("ddtree_sglang_cpu_lab.sgl_kernel_standin")

pytestmark = pytest.mark.sglang


def test_every_seam_is_where_and_what_the_work_around_expects():
    moved = seams.moved()
    assert moved == [], "\n".join(seams.moved_message(seam, digest) for seam, digest in moved)


def test_every_seam_names_a_work_around_of_the_layer():
    for seam in seams.SEAMS:
        importlib.import_module(f"ddtree_sglang_cpu_lab.{seam.workaround}")
        assert seam.limitation.strip()


def test_a_moved_seam_is_refused_with_what_to_re_read(monkeypatch):
    seam = seams.seam_named("sglang.srt.layers.attention.torch_native_backend",
                            "TorchNativeAttnBackend.forward_extend")
    stale = dataclasses.replace(seam, digest="0123456789abcdef")
    monkeypatch.setattr(seams, "SEAMS", tuple(stale if s is seam else s for s in seams.SEAMS))
    module = importlib.import_module(seam.module)
    with pytest.raises(seams.SeamMoved) as err:
        seams.require(module, seam.module, seam.qualname)
    text = str(err.value)
    assert seam.where in text and "verify_attention" in text and seam.limitation in text
    assert [s.where for s, _ in seams.moved()] == [seam.where]


def test_another_sglang_release_is_refused():
    seams.check_version("0.5.23")
    with pytest.raises(seams.SeamMoved, match=r"sglang 0\.5\.24"):
        seams.check_version("0.5.24")


def _req_to_token_case():
    req_to_token = torch.full((5, 40), -1, dtype=torch.int32)
    req_to_token[:, :] = torch.arange(200, dtype=torch.int32).view(5, 40)
    return (
        req_to_token,
        torch.tensor([3, 0, 4], dtype=torch.int64),
        torch.tensor([2, 0, 17], dtype=torch.int64),
        torch.tensor([9, 5, 20], dtype=torch.int64),
    )


def test_assign_req_to_token_pool_matches_sglangs_triton_kernel():
    from sglang.srt.mem_cache import allocation

    req_to_token, idx, start, end = _req_to_token_case()
    loc = torch.arange(1000, 1000 + int((end - start).sum()), dtype=torch.int64)
    want = req_to_token.clone()
    allocation.assign_req_to_token_pool[(3,)](idx, want, start, end, loc, want.shape[1], 4)
    got = req_to_token.clone()
    standin.assign_req_to_token_pool_cpu(idx, got, start, end, loc, got.shape[1])
    assert torch.equal(got, want)


def test_assign_extend_cache_locs_matches_sglangs_triton_kernel():
    from sglang.kernels.ops.speculative import cache_locs

    req_to_token, idx, start, end = _req_to_token_case()
    n = int((end - start).sum())
    want = torch.full((n,), -1, dtype=torch.int64)
    cache_locs.assign_extend_cache_locs[(3,)](idx, req_to_token, start, end, want, req_to_token.shape[1], 4)
    got = torch.full((n,), -1, dtype=torch.int64)
    standin.assign_extend_cache_locs_cpu(idx, req_to_token, start, end, got, req_to_token.shape[1])
    assert torch.equal(got, want)


def test_copy_all_layer_kv_cache_reads_every_source_before_writing():
    layers = [torch.randn(12, 2, 4, dtype=torch.bfloat16) for _ in range(3)]
    before = [t.clone() for t in layers]
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    strides = torch.tensor([t[0].numel() * t.element_size() for t in layers], dtype=torch.int64)
    src, tgt = torch.tensor([1, 2, 5]), torch.tensor([2, 1, 9])  # 1 <-> 2 swap, 5 -> 9
    standin.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for t, b in zip(layers, before, strict=True):
        want = b.clone()
        want[[2, 1, 9]] = b[[1, 2, 5]]
        assert torch.equal(t, want)


def test_an_op_the_lab_does_not_implement_fails_naming_it():
    module = standin.StandinModule("sgl_kernel")
    with pytest.raises(standin.MissingOp, match=r"sgl_kernel\.fused_add_rmsnorm_cpu"):
        module.fused_add_rmsnorm_cpu(torch.zeros(1))


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DDTREE_", "SGLANG_"))}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_the_layer_is_inert_unless_switched_on():
    code = "import importlib.util, sys; print(importlib.util.find_spec('sgl_kernel') is not None)"
    assert _python(code).stdout.strip() == "False"
    on = _python(code, DDTREE_SGLANG_CPU_LAB="1")
    assert on.stdout.strip() == "True", on.stderr


def test_an_unknown_fault_switch_refuses_to_start():
    proc = _python("print('started')", DDTREE_SGLANG_CPU_LAB="1", DDTREE_LAB_FAULT="slow_start")
    assert proc.returncode != 0 and "started" not in proc.stdout
    assert "DDTREE_LAB_FAULT='slow_start'" in proc.stderr and "capture_predicate" in proc.stderr


def test_the_verify_faults_patch_the_plugins_round(monkeypatch):
    """relaxed_accept and verify_causal_mask replace what run_tree_round calls (restored after the test);
    the lab hosts' lossless probe sees the first (tests/lab/test_real_sglang_lab.py)."""
    faults = importlib.import_module("ddtree_sglang_cpu_lab.faults")
    from ddtree_runtime.sglang_plugin.round import tree_round

    monkeypatch.setattr(tree_round, "plan_tree_verify", tree_round.plan_tree_verify)
    monkeypatch.setattr(tree_round, "walk_round", tree_round.walk_round)
    draft_logits = torch.randn(2, 3, 12, generator=torch.Generator().manual_seed(0))
    roots, prefix, budget = torch.tensor([1, 2]), torch.tensor([5, 3]), 6
    honest = tree_round.plan_tree_verify(draft_logits, roots, prefix, budget)

    faults._verify_causally(tree_round)
    causal = tree_round.plan_tree_verify(draft_logits, roots, prefix, budget)
    rows = budget + 1
    offset = 0
    for p in prefix.tolist():
        size = rows * (p + rows)
        tree = torch.ones(rows, rows).tril().bool()
        want = torch.cat([torch.ones(rows, p, dtype=torch.bool), tree], dim=1)
        assert torch.equal(causal.custom_mask[offset: offset + size].view(rows, -1), want)
        assert not torch.equal(honest.custom_mask[offset: offset + size], causal.custom_mask[offset:][:size])
        offset += size
    assert torch.equal(causal.draft_token, honest.draft_token)
    assert torch.equal(causal.positions, honest.positions)

    # The root's first drafted child, which the target ranks second (p 0.3): only the relaxed walk takes it.
    child = int((honest.tree.parents[0, 1:] == 0).nonzero()[0]) + 1
    token = int(honest.tree.tokens[0, child - 1])
    drafted = set(honest.tree.tokens[0][honest.tree.parents[0, 1:] == 0].tolist())
    top1 = min(set(range(12)) - drafted)  # the target's first choice at the root: not drafted
    logits = torch.full((2, rows, 12), -30.0)
    logits[:, :, top1] = 0.0
    logits[0, 0, token] = math.log(0.3 / 0.7)
    honest_walk = tree_round.walk_round(honest, logits.reshape(2 * rows, 12), None)
    faults._walk_relaxed(tree_round)
    relaxed_walk = tree_round.walk_round(honest, logits.reshape(2 * rows, 12), None)
    assert int(honest_walk.num_accepted[0]) == 1 and int(honest_walk.emitted[0, 0]) != token
    assert int(relaxed_walk.num_accepted[0]) >= 2 and int(relaxed_walk.emitted[0, 0]) == token
    assert torch.equal(relaxed_walk.emitted[1], honest_walk.emitted[1])  # nothing relaxed there
