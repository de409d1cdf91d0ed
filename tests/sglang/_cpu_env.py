"""Make SGLang's import chain work on this CPU-only test machine.

``sglang.srt.configs`` imports ``torchvision.transforms`` (for InternVL image constants). PyPI's
torchvision wheels are CUDA builds: beside the CPU torch their ``_C`` extension cannot load
(it links libtorch_cuda), and torchvision 0.28 then fails at import because it registers fake
kernels for ``torchvision::nms`` / ``torchvision::qnms``, ops its extension would have defined.
Defining those two operator *schemas* (no kernels) lets the import finish; nothing in these
tests calls them. A GPU host has a working torchvision and never runs this.
"""

from __future__ import annotations

_LIBRARY = None  # keeps the torch.library.Library alive for the process


def define_torchvision_op_schemas() -> None:
    global _LIBRARY
    import torch

    try:
        torch._C._dispatch_find_schema_or_throw("torchvision::nms", "")
        return  # a working torchvision (or an earlier call) defined them
    except RuntimeError:
        pass
    _LIBRARY = torch.library.Library("torchvision", "DEF")
    _LIBRARY.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBRARY.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
