"""SGLang code pinned by content: the seam mechanism of both lab layers.

A work-around keys on SGLang 0.5.23's module and function names and on what those functions do. Each
seam records the function's source digest as read when the work-around was written; ``moved()`` lists
the seams whose source changed in the installed wheel, and a work-around refuses to patch a moved seam
(``require``), so a new wheel fails loudly at start-up instead of serving on a stale patch.

A layer reads the source one of two ways (its digests were taken that way, so it keeps it):
``object`` from the imported function (``inspect``: the CPU layer, whose modules all import on a CPU),
``file`` from the module's file (``ast``: the GPU layer, several of whose modules refuse to import
without CUDA, so its seams are checked on CPU all the same).
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

from ddtree_sglang_lab_base import PINNED_SGLANG_VERSION


@dataclass(frozen=True)
class Seam:
    module: str
    qualname: str
    digest: str  # sha256 of the source (trailing whitespace stripped), first 16 hex digits
    limitation: str  # the SGLang limitation the work-around answers
    workaround: str  # the module of the layer that relies on it

    @property
    def where(self) -> str:
        return f"{self.module}.{self.qualname}"


class SeamMoved(RuntimeError):
    pass


def _digest(source: str) -> str:
    normalized = "\n".join(line.rstrip() for line in source.splitlines())
    return hashlib.sha256(normalized.encode()).hexdigest()[:16]


def object_digest(obj: Any) -> str:
    """The digest of an imported function's or class's source (decorators and indentation included)."""
    return _digest(inspect.getsource(inspect.unwrap(obj)))


def file_digest(module: str, qualname: str) -> str:
    """The digest of ``qualname``'s definition in ``module``'s file, without importing the module."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise SeamMoved(f"SGLang module {module} is gone")
    return _digest(_def_in_file(spec.origin, qualname))


@cache
def _def_in_file(path: str, qualname: str) -> str:
    with open(path, encoding="utf-8") as f:
        source = f.read()
    body: list[ast.stmt] = ast.parse(source).body
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = _find(body, part)
        if node is None:
            raise SeamMoved(f"{qualname} is gone from {path}")
        body = node.body  # type: ignore[attr-defined]
    return ast.get_source_segment(source, node) or ""  # type: ignore[arg-type]


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


def resolve(seam: Seam) -> Any:
    obj: Any = importlib.import_module(seam.module)
    for part in seam.qualname.split("."):
        obj = getattr(obj, part)
    return obj


class Seams:
    """One layer's seams. ``seams`` is called each time (the layer's module-level ``SEAMS``, which a test
    may swap for a stale copy)."""

    def __init__(
        self,
        distribution: str,
        package: str,
        seams: Callable[[], tuple[Seam, ...]],
        *,
        read: Literal["object", "file"],
    ) -> None:
        self.distribution = distribution
        self.package = package
        self._seams = seams
        self.read = read

    def seam_named(self, module: str, qualname: str) -> Seam:
        for seam in self._seams():
            if seam.module == module and seam.qualname == qualname:
                return seam
        raise KeyError(f"{module}.{qualname} is not a registered seam")

    def digest(self, seam: Seam, owner: Any = None) -> str:
        """The seam's digest in the installed wheel; ``owner`` is the already-imported module holding
        it (read as is, no import), else the module is imported (``object``) or read (``file``)."""
        if self.read == "file":
            try:
                return file_digest(seam.module, seam.qualname)
            except SeamMoved as exc:
                raise SeamMoved(f"{self.distribution}: {exc}") from None
        if owner is None:
            return object_digest(resolve(seam))
        obj = owner
        for part in seam.qualname.split("."):
            obj = getattr(obj, part)
        return object_digest(obj)

    def moved_message(self, seam: Seam, digest: str) -> str:
        return (
            f"{self.distribution}: SGLang's {seam.where} is not the code the work-around "
            f"'{seam.workaround}' was written against (source digest {digest}, expected {seam.digest}; "
            f"it works around: {seam.limitation}). Re-read it in the installed wheel, adjust "
            f"{self.package}/{seam.workaround}.py and the digest in seams.py."
        )

    def require(self, owner: Any, module: str, qualname: str) -> None:
        """Called by a work-around on the module it is about to patch: raise SeamMoved if the seam moved."""
        seam = self.seam_named(module, qualname)
        digest = self.digest(seam, owner)
        if digest != seam.digest:
            raise SeamMoved(self.moved_message(seam, digest))

    def moved(self) -> list[tuple[Seam, str]]:
        """Every seam whose source differs in the installed wheel, with its digest there."""
        return [(s, d) for s in self._seams() if (d := self.digest(s)) != s.digest]

    def check_version(self, version: str) -> None:
        if version != PINNED_SGLANG_VERSION:
            raise SeamMoved(
                f"{self.distribution} was written against sglang=={PINNED_SGLANG_VERSION}; this "
                f"environment has sglang {version}. Re-read every seam in {self.package}/seams.py against "
                "it before using it."
            )
