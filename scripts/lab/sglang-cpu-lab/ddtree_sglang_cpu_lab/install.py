"""Every work-around, in the order SGLang meets them (``base.layer.install_layer`` checks first)."""

from __future__ import annotations

from ddtree_sglang_lab_base.layer import Refused, install_layer

PIECES = (
    "torchvision_ops",
    "sgl_kernel_standin",
    "dflash_on_cpu",
    "verify_attention",
    "drafter_rope",
    "faults",
)

__all__ = ["PIECES", "Refused", "install_all"]


def install_all() -> None:
    install_layer("ddtree_sglang_cpu_lab", PIECES)
