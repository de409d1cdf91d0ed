"""The SGLang code each GPU-lab work-around relies on, pinned by content.

As in the CPU layer (``ddtree_sglang_cpu_lab.seams``), each seam records a source digest taken when
the work-around was written, and a work-around refuses to patch a moved seam. Digests are read from
the module's file (``ast``), not from an imported object: several of these modules refuse to import
without CUDA (``weak_ref_tensor.py`` raises on a CPU), and ``tests/sglang/test_gpu_lab_seams.py`` checks
them all on CPU against the installed wheel.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from dataclasses import dataclass
from functools import cache
from types import ModuleType

from ddtree_sglang_gpu_lab import PINNED_SGLANG_VERSION


@dataclass(frozen=True)
class Seam:
    module: str
    qualname: str
    digest: str  # sha256 of the def's source (trailing whitespace stripped), first 16 hex digits
    limitation: str  # the SGLang limitation the work-around answers
    workaround: str  # the module of this package that relies on it

    @property
    def where(self) -> str:
        return f"{self.module}.{self.qualname}"


class SeamMoved(RuntimeError):
    pass


SEAMS: tuple[Seam, ...] = (
    Seam(
        "sglang.srt.layers.layernorm",
        "RMSNorm.forward_cuda",
        "bae8ae6279fa203d",
        "RMSNorm on CUDA calls sgl_kernel.rmsnorm(x, w, eps) / fused_add_rmsnorm(x, residual, w, eps)",
        "sgl_kernel_standin",
    ),
    Seam(
        "sglang.srt.layers.layernorm",
        "GemmaRMSNorm._forward_impl",
        "74f6f0cb265efd4b",
        "GemmaRMSNorm on CUDA calls sgl_kernel.gemma_rmsnorm / gemma_fused_add_rmsnorm(x, residual, w, eps)",
        "sgl_kernel_standin",
    ),
    Seam(
        "sglang.srt.model_executor.runner_backend_utils.weak_ref_tensor",
        "weak_ref_tensors",
        "0f23162ad370068f",
        "the breakable prefill graph weak-references its outputs through sgl_kernel.weak_ref_tensor",
        "sgl_kernel_standin",
    ),
    Seam(
        "sglang.srt.layers.dual_gemm",
        "DualGemm._select_mode",
        "0f62a9ccc2919ad0",
        "every dense MLP imports the CUTLASS-DSL dual GEMM module to ask can_use_dual_gemm (SM100 only)",
        "cutedsl_standin",
    ),
    Seam(
        "sglang.srt.speculative.dflash_utils",
        "is_dflash_sampling_verify_available",
        "dfc33a0545717023",
        "DFLASH's sampling verify kernel compiles against flashinfer's headers; without it SGLang verifies "
        "greedily",
        "sampling_fallback",
    ),
)


def _def_source(module: str, qualname: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise SeamMoved(f"ddtree-sglang-gpu-lab: SGLang module {module} is gone")
    return _def_in_file(spec.origin, qualname)


@cache
def _def_in_file(path: str, qualname: str) -> str:
    with open(path, encoding="utf-8") as f:
        source = f.read()
    body: list[ast.stmt] = ast.parse(source).body
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = _find(body, part)
        if node is None:
            raise SeamMoved(f"ddtree-sglang-gpu-lab: {qualname} is gone from {path}")
        body = node.body  # type: ignore[attr-defined]
    segment = ast.get_source_segment(source, node)  # type: ignore[arg-type]
    return "\n".join(line.rstrip() for line in (segment or "").splitlines())


def _find(body: list[ast.stmt], name: str) -> ast.AST | None:
    """The class or def named ``name`` in ``body``, looking inside module-level ``if`` blocks too
    (SGLang defines its CUDA-only functions under ``if _is_cuda:``)."""
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == name:
            return stmt
        if isinstance(stmt, ast.If):
            found = _find(stmt.body, name) or _find(stmt.orelse, name)
            if found is not None:
                return found
    return None


def source_digest(module: str, qualname: str) -> str:
    return hashlib.sha256(_def_source(module, qualname).encode()).hexdigest()[:16]


def seam_named(module: str, qualname: str) -> Seam:
    for seam in SEAMS:
        if seam.module == module and seam.qualname == qualname:
            return seam
    raise KeyError(f"{module}.{qualname} is not a registered seam")


def moved_message(seam: Seam, digest: str) -> str:
    return (
        f"ddtree-sglang-gpu-lab: SGLang's {seam.where} is not the code the work-around "
        f"'{seam.workaround}' was written against (source digest {digest}, expected {seam.digest}; "
        f"it works around: {seam.limitation}). Re-read it in the installed wheel, adjust "
        f"ddtree_sglang_gpu_lab/{seam.workaround}.py and the digest in seams.py."
    )


def require(owner: ModuleType, module: str, qualname: str) -> None:
    """Called by a work-around on the module it is about to patch: raise SeamMoved if the seam moved."""
    seam = seam_named(module, qualname)
    digest = source_digest(module, qualname)
    if digest != seam.digest:
        raise SeamMoved(moved_message(seam, digest))


def moved() -> list[tuple[Seam, str]]:
    """Every seam whose source differs in the installed wheel, with its digest there."""
    return [(s, d) for s in SEAMS if (d := source_digest(s.module, s.qualname)) != s.digest]


def check_version(version: str) -> None:
    if version != PINNED_SGLANG_VERSION:
        raise SeamMoved(
            f"ddtree-sglang-gpu-lab was written against sglang=={PINNED_SGLANG_VERSION}; this environment "
            f"has sglang {version}. Re-read every seam in seams.py against it before using it."
        )
