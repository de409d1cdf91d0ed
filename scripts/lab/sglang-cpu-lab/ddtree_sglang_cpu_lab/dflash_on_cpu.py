"""The DFlash family (DFLASH, and DDTREE on top of it) on SGLang's CPU platform.

Three SGLang limitations, each worked around for one call site:

* ``speculative_hook._handle_dflash`` accepts DFLASH only on cuda/npu/xpu or on an out-of-tree
  platform that says it supports it; the CPU platform is in-tree ("DFLASH speculative decoding is
  not supported by CpuSRTPlatform on device 'cpu'"). For that call, and for the draft-backend choice
  after it (``_resolve_dflash_draft_attention_backend``), the platform answers as an out-of-tree
  platform supporting DFLASH with a ``torch_native`` draft backend. The rest of their validation
  (pp size, draft path, dp attention, block size) runs unchanged.
* ``torch_native`` is not among SGLang's draft attention backends; SGLang's own extension point
  (``choices.add_draft_attention_backend_choices``) adds it.
* ``DFlashWorkerV2.forward_batch_generation`` calls ``batch.seq_lens.record_stream`` with the CPU
  device module's stream, which ``Tensor.record_stream`` rejects ("unknown parameter type").
  ``record_stream`` becomes a no-op for CPU tensors (there are no streams to order on a CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from ddtree_sglang_lab_base.hooks import after_import

from ddtree_sglang_cpu_lab.seams import require

DRAFT_BACKEND = "torch_native"
DFLASH_FAMILY = ("DFLASH",)


class DFlashCapableCpuPlatform:
    """The CPU platform, answering DFLASH's platform questions as an out-of-tree platform would."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)

    def is_out_of_tree(self) -> bool:
        return True

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return algorithm in DFLASH_FAMILY

    def supports_speculative_draft_attention_backend(self, algorithm: str, backend: str) -> bool:
        return algorithm in DFLASH_FAMILY and backend == DRAFT_BACKEND

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return DRAFT_BACKEND


def _with_cpu_platform(module: ModuleType, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        real = module.current_platform
        if not real.is_cpu():
            return fn(*args, **kwargs)
        module.current_platform = DFlashCapableCpuPlatform(real)
        try:
            return fn(*args, **kwargs)
        finally:
            module.current_platform = real

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call


def _patch_speculative_hook(module: ModuleType) -> None:
    for name in ("_handle_dflash", "_resolve_dflash_draft_attention_backend"):
        require(module, module.__name__, name)
        setattr(module, name, _with_cpu_platform(module, getattr(module, name)))


def _check_record_stream_site(module: ModuleType) -> None:
    require(module, module.__name__, "DFlashWorkerV2.forward_batch_generation")


def _add_draft_backend(module: ModuleType) -> None:
    if DRAFT_BACKEND not in module.DRAFT_ATTENTION_BACKEND_CHOICES:
        module.add_draft_attention_backend_choices([DRAFT_BACKEND])


_record_stream = torch.Tensor.record_stream


def _record_stream_cpu_noop(self: torch.Tensor, stream: Any) -> None:
    if self.device.type == "cpu":
        return None
    return _record_stream(self, stream)


def install() -> None:
    after_import("sglang.srt.arg_groups.speculative_hook", _patch_speculative_hook)
    after_import("sglang.srt.arg_groups.choices", _add_draft_backend)
    after_import("sglang.srt.speculative.dflash_worker_v2", _check_record_stream_site)
    torch.Tensor.record_stream = _record_stream_cpu_noop  # type: ignore[method-assign]
