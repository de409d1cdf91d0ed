"""A stand-in for a compiled kernel package (``sgl_kernel``) that is not installed: both layers' mechanism.

Every name of the stand-in resolves: the ops in ``implemented`` are plain versions of the real ones, any
other op is a function that raises :class:`MissingOp` naming itself when called (so SGLang's import-time
``from sgl_kernel import ...`` succeeds, and a path the lab cannot serve fails loudly, not silently). Its
submodules resolve too when ``submodules`` is set, except ``unimportable`` ones (SGLang answers their
ImportError with a fallback of its own); else none does. It goes on the import path only when no real
package is importable, and checks, as SGLang imports them, that the callers of the implemented ops are
the code the ops were written for (their argument order is the seam).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from ddtree_sglang_lab_base.hooks import after_import


class MissingOp(NotImplementedError):
    pass


class StandinModule(ModuleType):
    """The stand-in package or one of its submodules; ``standin`` is set on the subclass each
    :class:`StandinPackage` makes."""

    standin: StandinPackage

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        prefix = self.__name__[len(self.standin.name) + 1 :]
        key = f"{prefix}.{name}" if prefix else name
        if key in self.standin.implemented:
            return self.standin.implemented[key]
        return self.standin.missing_op(f"{self.__name__}.{name}")


class _Loader(importlib.abc.Loader):
    def __init__(self, standin: StandinPackage) -> None:
        self._standin = standin

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = self._standin.module_class(spec.name)
        module.__path__ = []  # a package: its submodules, where they resolve, come from the finder
        module.__version__ = self._standin.version
        return module

    def exec_module(self, module: ModuleType) -> None:
        return None


class StandinFinder(importlib.abc.MetaPathFinder):
    def __init__(self, standin: StandinPackage) -> None:
        self.standin = standin

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if self.standin.resolves(fullname):
            return importlib.machinery.ModuleSpec(fullname, _Loader(self.standin), is_package=True)
        return None


class StandinPackage:
    def __init__(
        self,
        name: str,
        version: str,
        implemented: Mapping[str, Any],
        *,
        missing: str,
        callers: Mapping[str, tuple[str, ...]],
        require: Callable[[ModuleType, str, str], None],
        submodules: bool = False,
        unimportable: tuple[str, ...] = (),
    ) -> None:
        """``implemented``: op name (``sub.op`` for a submodule's) to function; ``missing``: the message
        of an op nobody implemented, with ``{op}`` and ``{implemented}``; ``callers``: SGLang module to
        the qualnames calling the implemented ops, checked with the layer's seams' ``require``."""
        self.name = name
        self.version = version
        self.implemented = implemented
        self.missing = missing
        self.callers = callers
        self.require = require
        self.submodules = submodules
        self.unimportable = unimportable
        self.module_class: type[StandinModule] = type("StandinModule", (StandinModule,), {"standin": self})

    def resolves(self, fullname: str) -> bool:
        if fullname == self.name:
            return True
        if not self.submodules or not fullname.startswith(f"{self.name}."):
            return False
        return fullname.split(".")[1] not in self.unimportable

    def missing_op(self, qualname: str) -> Callable[..., Any]:
        def op(*args: Any, **kwargs: Any) -> Any:
            implemented = ", ".join(sorted(self.implemented))
            raise MissingOp(self.missing.format(op=qualname, implemented=implemented))

        op.__name__ = qualname.rsplit(".", 1)[-1]
        op.__qualname__ = qualname
        return op

    def _check_callers(self, module: ModuleType) -> None:
        for qualname in self.callers[module.__name__]:
            self.require(module, module.__name__, qualname)

    def install(self) -> bool:
        """Put the stand-in on the import path unless a real package of that name is importable."""
        if any(isinstance(f, StandinFinder) and f.standin is self for f in sys.meta_path):
            return True
        if importlib.util.find_spec(self.name) is not None:
            return False
        sys.meta_path.append(StandinFinder(self))
        for module in self.callers:
            after_import(module, self._check_callers)
        return True
