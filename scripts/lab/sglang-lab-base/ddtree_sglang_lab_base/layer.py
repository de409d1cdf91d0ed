"""A lab layer's life in a process: the boot its ``.pth`` runs, the install of its pieces, the refusal,
and the ``DDTREE_LAB_FAULT`` switch. Both layers run this one sequence; each names its own pieces.

A layer package ``P`` holds ``P.seams`` (``check_version``), ``P.faults`` (``selected_fault``) and one
module per piece with an ``install()``. Nothing here imports SGLang: the boot runs at interpreter start,
before SGLang's own set-up, and each piece patches SGLang when SGLang first imports what it patches.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Collection, Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version

from ddtree_sglang_lab_base.seams import SeamMoved

# The lab's one fault switch: the lab engine reads it too (ddtree_runtime.tiny_engine.faults).
FAULT_ENV = "DDTREE_LAB_FAULT"

_installed: set[str] = set()  # the layer packages installed in this process


class Refused(RuntimeError):
    pass


class UnknownFault(ValueError):
    pass


def selected_fault(known: Collection[str], why: str, env: Mapping[str, str] | None = None) -> str | None:
    """The fault switch's value (None when unset); UnknownFault, with ``why``, when the layer has no such
    switch."""
    fault = (os.environ if env is None else env).get(FAULT_ENV) or None
    if fault is not None and fault not in known:
        raise UnknownFault(f"{FAULT_ENV}={fault!r}: {why}")
    return fault


def install_layer(package: str, pieces: Sequence[str]) -> None:
    """Refuse another SGLang release or an unknown fault switch, then install ``package``'s ``pieces``
    (its modules, each with ``install()``) in order; once per process."""
    if package in _installed:
        return
    seams = importlib.import_module(f"{package}.seams")
    faults = importlib.import_module(f"{package}.faults")
    modules = [importlib.import_module(f"{package}.{piece}") for piece in pieces]
    try:
        seams.check_version(version("sglang"))
        faults.selected_fault()
    except PackageNotFoundError as exc:
        raise Refused("sglang is not installed in this environment") from exc
    except (SeamMoved, UnknownFault) as exc:
        raise Refused(str(exc)) from exc
    for module in modules:
        module.install()
    _installed.add(package)


def boot(distribution: str, env_flag: str, package: str) -> None:
    """What a layer's ``.pth`` runs at every interpreter start: nothing unless ``env_flag=1``; then the
    layer's ``install_all``, or the interpreter ends with the reason (a lab server must not start half
    patched)."""
    if os.environ.get(env_flag) != "1":
        return
    install = importlib.import_module(f"{package}.install")
    try:
        install.install_all()
    except Refused as exc:
        raise SystemExit(f"{distribution} refused to start: {exc}") from None
