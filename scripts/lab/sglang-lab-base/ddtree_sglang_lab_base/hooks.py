"""Run a function right after a module is imported (or now, when it already is).

The boot cannot import SGLang itself (it runs at interpreter start, before SGLang's own set-up), so
each work-around is applied when SGLang first imports the module it patches.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType

_pending: dict[str, list[Callable[[ModuleType], None]]] = {}


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _RunAfter(spec.loader, fullname)
                return spec
        return None


class _RunAfter(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, name: str) -> None:
        self._loader = loader
        self._name = name

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._loader, name)  # get_source, get_resource_reader, ... of the real loader

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for fn in _pending.pop(self._name, []):
            fn(module)


_FINDER = _AfterImportFinder()


def after_import(module_name: str, fn: Callable[[ModuleType], None]) -> None:
    module = sys.modules.get(module_name)
    if module is not None:
        fn(module)
        return
    _pending.setdefault(module_name, []).append(fn)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
