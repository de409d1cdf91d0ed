"""Every work-around, in the order SGLang meets them (``base.layer.install_layer`` checks first)."""

from __future__ import annotations

from ddtree_sglang_lab_base.layer import Refused, install_layer

PIECES = (
    "sgl_kernel_standin",
    "cutedsl_standin",
    "sampling_fallback",
    "faults",
    "sync_watch",
)

__all__ = ["PIECES", "Refused", "install_all"]


def install_all() -> None:
    install_layer("ddtree_sglang_gpu_lab", PIECES)
