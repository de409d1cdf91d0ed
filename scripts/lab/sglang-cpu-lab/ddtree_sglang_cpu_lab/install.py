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
    from ddtree_sglang_cpu_lab import (
        dflash_on_cpu,
        drafter_rope,
        faults,
        seams,
        sgl_kernel_standin,
        torchvision_ops,
        verify_attention,
    )

    try:
        seams.check_version(version("sglang"))
        faults.selected_fault()
    except PackageNotFoundError as exc:
        raise Refused("sglang is not installed in this venv") from exc
    except (seams.SeamMoved, faults.UnknownFault) as exc:
        raise Refused(str(exc)) from exc
    torchvision_ops.install()
    sgl_kernel_standin.install()
    dflash_on_cpu.install()
    verify_attention.install()
    drafter_rope.install()
    faults.install()
    _installed = True
