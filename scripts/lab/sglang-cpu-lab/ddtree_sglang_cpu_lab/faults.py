"""Test-only switches that reproduce the field failures in the real server (``DDTREE_LAB_FAULT``, the same
switch the lab engine reads). Not work-arounds: the server runs SGLang's own capture code, broken the
way a build in the field was.

* ``capture_predicate``: the DFlash-family predicate that decides hidden-state capture
  (``spec_aux_hidden_state._resolve_dflash_aux_hidden_state`` asks ``is_dflash_family()``) leaves DDTREE
  out, so SGLang never tells the target which layers to capture and hands the drafter the target's
  last hidden state, ``[N, H]`` instead of ``[N, k*H]``;
* ``hidden_none``: the target's forwards run with capture mode NULL (a capture mode that does not
  reach the target), so SGLang's logits processor returns no hidden states at all.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

from ddtree_sglang_cpu_lab.hooks import after_import
from ddtree_sglang_cpu_lab.seams import require

FAULT_ENV = "DDTREE_LAB_FAULT"
FAULTS = ("capture_predicate", "hidden_none")


class UnknownFault(ValueError):
    pass


class _FamilyWithoutPlugins:
    """An algorithm whose ``is_dflash_family()`` answers as the built-in enum's tuple does (a
    plugin-registered algorithm is not in it)."""

    def __init__(self, algorithm: Any) -> None:
        self._algorithm = algorithm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._algorithm, name)

    def is_dflash_family(self) -> bool:
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        return isinstance(self._algorithm, SpeculativeAlgorithm) and self._algorithm.is_dflash_family()


def _leave_plugins_out_of_capture(module: ModuleType) -> None:
    require(module, module.__name__, "_resolve_dflash_aux_hidden_state")
    resolve = module._resolve_dflash_aux_hidden_state

    def resolve_with_enum_predicate(*, spec_algorithm: Any, **kwargs: Any) -> None:
        return resolve(spec_algorithm=_FamilyWithoutPlugins(spec_algorithm), **kwargs)

    resolve_with_enum_predicate.__wrapped__ = resolve  # type: ignore[attr-defined]
    module._resolve_dflash_aux_hidden_state = resolve_with_enum_predicate


def _target_forwards_capture_nothing(module: ModuleType) -> None:
    require(module, module.__name__, "ModelRunner.forward")
    runner_cls = module.ModelRunner
    forward = runner_cls.forward

    def forward_without_capture(self: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.is_draft_worker:
            from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

            forward_batch.capture_hidden_mode = CaptureHiddenMode.NULL
        return forward(self, forward_batch, *args, **kwargs)

    forward_without_capture.__wrapped__ = forward  # type: ignore[attr-defined]
    runner_cls.forward = forward_without_capture


def selected_fault(env: dict[str, str] | None = None) -> str | None:
    fault = (os.environ if env is None else env).get(FAULT_ENV) or None
    if fault is not None and fault not in FAULTS:
        raise UnknownFault(
            f"{FAULT_ENV}={fault!r}: the real-SGLang lab engine reproduces {', '.join(FAULTS)}; the "
            "other lab faults exist only in the lab engine (sglang_service_engine: lab)"
        )
    return fault


def install() -> None:
    fault = selected_fault()
    if fault == "capture_predicate":
        after_import(
            "sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state",
            _leave_plugins_out_of_capture,
        )
    elif fault == "hidden_none":
        after_import("sglang.srt.model_executor.model_runner", _target_forwards_capture_nothing)
