"""SGLang limitation: ``sglang.srt.configs`` imports ``torchvision.transforms``; PyPI's torchvision is a
CUDA build whose C++ ops cannot load beside the CPU torch, and its import then fails on registering
fake kernels for ``torchvision::nms`` / ``qnms``. Defining the two operator schemas (no kernels) lets
the import finish; nothing on the lab's text-only path calls them. Without torchvision installed this
does nothing."""

from __future__ import annotations

import importlib.util

_LIBRARY = None  # keeps the definitions alive for the process


def install() -> None:
    global _LIBRARY
    if importlib.util.find_spec("torchvision") is None:
        return
    import torch

    try:
        torch._C._dispatch_find_schema_or_throw("torchvision::nms", "")
        return  # a working torchvision build defines them
    except RuntimeError:
        pass
    _LIBRARY = torch.library.Library("torchvision", "DEF")
    _LIBRARY.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBRARY.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
