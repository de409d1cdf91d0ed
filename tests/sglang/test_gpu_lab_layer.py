"""The GPU lab's layer (scripts/lab/sglang-gpu-lab/) against the installed SGLang wheel, on CPU.

Every work-around relies on SGLang 0.5.23 code by name and content (``seams.SEAMS``): these tests fail
when the wheel moves one. The stand-ins that decide what the served model computes are checked against
SGLang's own plain references (here on CPU; tests/gpu/test_gpu_lab_layer.py on the H200), and the layer
must stay inert unless the GPU lab switches it on.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import os
import subprocess
import sys

import pytest

from tests._gpu_lab_checks import check_norms_match_sglangs_native, check_silu_and_mul_matches_sglangs_native

seams = pytest.importorskip("ddtree_sglang_gpu_lab.seams")

pytestmark = pytest.mark.sglang


def test_every_seam_is_where_and_what_the_work_around_expects():
    moved = seams.moved()
    assert moved == [], "\n".join(seams.moved_message(seam, digest) for seam, digest in moved)


def test_every_seam_names_a_work_around_of_the_layer():
    for seam in seams.SEAMS:
        importlib.import_module(f"ddtree_sglang_gpu_lab.{seam.workaround}")
        assert seam.limitation.strip()


def test_a_moved_seam_is_refused_with_what_to_re_read(monkeypatch):
    seam = seams.seam_named("sglang.srt.layers.dual_gemm", "DualGemm._select_mode")
    stale = dataclasses.replace(seam, digest="0123456789abcdef")
    monkeypatch.setattr(seams, "SEAMS", tuple(stale if s is seam else s for s in seams.SEAMS))
    import sglang.srt.layers.dual_gemm as module

    with pytest.raises(seams.SeamMoved, match=r"DualGemm\._select_mode.*cutedsl_standin"):
        seams.require(module, seam.module, seam.qualname)


def test_another_sglang_release_is_refused():
    with pytest.raises(seams.SeamMoved, match=r"0\.5\.23"):
        seams.check_version("0.5.24")


def test_the_standin_norms_compute_what_sglangs_native_norms_compute():
    check_norms_match_sglangs_native("cpu")


def test_the_standin_activation_computes_what_sglangs_native_one_computes():
    check_silu_and_mul_matches_sglangs_native("cpu")


def test_the_dual_gemm_standin_keeps_the_real_modules_constants_and_answers_as_sm90_does():
    from ddtree_sglang_gpu_lab import cutedsl_standin

    path = importlib.util.find_spec("sglang.kernels.ops.gemm").submodule_search_locations[0]
    with open(os.path.join(path, "cutedsl_dual_gemm.py")) as f:
        tree = ast.parse(f.read())
    consts = {n.targets[0].id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
              and isinstance(n.targets[0], ast.Name) and isinstance(n.value, ast.Constant)}  # fmt: skip
    (enum,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DualGemmQuantMode"]
    members = {s.targets[0].id: s.value.value for s in enum.body if isinstance(s, ast.Assign)}
    assert consts["MAX_DUAL_GEMM_DECODE_TOKENS"] == cutedsl_standin.MAX_DUAL_GEMM_DECODE_TOKENS
    assert members == {m.name: m.value for m in cutedsl_standin.DualGemmQuantMode}
    assert not any(cutedsl_standin.can_use_dual_gemm(t, 5120, 17408, 4) for t in (1, 8, 16))


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    child = {k: v for k, v in os.environ.items() if not k.startswith("DDTREE_SGLANG_")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**child, **env})  # fmt: skip


def test_the_layer_is_inert_unless_the_gpu_lab_switches_it_on():
    probe = "import importlib.util, sys; print(importlib.util.find_spec('sgl_kernel') is not None)"
    off = _python(probe)
    assert off.returncode == 0 and off.stdout.strip() == "False", off.stderr
    on = _python(probe, DDTREE_SGLANG_GPU_LAB="1")
    assert on.returncode == 0 and on.stdout.strip() == "True", on.stderr


def test_an_unknown_fault_switch_refuses_to_start():
    proc = _python("pass", DDTREE_SGLANG_GPU_LAB="1", DDTREE_LAB_FAULT="nonsense")
    assert proc.returncode != 0 and "not a GPU-lab fault switch" in proc.stderr


def test_sync_watch_counts_the_syncs_of_decode_forwards_only(monkeypatch, capsys):
    """What the device suite reads to fail a tree decode that syncs (CUDA's sync debug mode warns
    at each synchronizing call; here a fake forward warns as torch does)."""
    import warnings
    from types import SimpleNamespace

    import torch
    from ddtree_sglang_gpu_lab import sync_watch

    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def forward(self, batch, **kwargs):
        for _ in range(batch.syncs):
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        return "out"

    watched = sync_watch.watched(forward, "DDTREE")

    def batch(extend: bool, syncs: int):
        mode = SimpleNamespace(is_extend=lambda: extend, is_idle=lambda: False)
        return SimpleNamespace(forward_mode=mode, is_extend_in_batch=False, reqs=[1, 2], syncs=syncs)

    assert watched(None, batch(False, 2), on_publish=None) == "out"
    assert watched(None, batch(True, 3)) == "out"  # a prefill: not counted
    assert watched(None, batch(False, 0)) == "out"
    assert modes == ["warn", "default", "warn", "default"]
    records = sync_watch.parse(capsys.readouterr().err)
    assert [r["syncs"] for r in records] == [2, 0] and records[0]["bs"] == 2
    assert records[0]["worker"] == "DDTREE" and records[0]["sites"][0].startswith("test_gpu_lab_layer.py:")
