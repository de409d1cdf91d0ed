"""Every work-around, in the order SGLang meets them."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

_installed = False


class Refused(RuntimeError):
    pass


def install_all() -> None:
    global _installed
    if _installed:
        return
    from ddtree_sglang_gpu_lab import (
        cutedsl_standin,
        faults,
        sampling_fallback,
        seams,
        sgl_kernel_standin,
        sync_watch,
    )

    try:
        seams.check_version(version("sglang"))
        faults.selected_fault()
    except PackageNotFoundError as exc:
        raise Refused("sglang is not installed in this environment") from exc
    except (seams.SeamMoved, faults.UnknownFault) as exc:
        raise Refused(str(exc)) from exc
    sgl_kernel_standin.install()
    cutedsl_standin.install()
    sampling_fallback.install()
    faults.install()
    sync_watch.install()
    _installed = True
