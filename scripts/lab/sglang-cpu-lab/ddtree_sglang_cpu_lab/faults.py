"""Test-only switches that reproduce the field failures in the real server (``DDTREE_LAB_FAULT``, the same
switch the lab engine reads). Not work-arounds: the server runs SGLang's own capture code, broken the
way a build in the field was.

* ``capture_predicate``: the DFlash-family predicate that decides hidden-state capture
  (``spec_aux_hidden_state._resolve_dflash_aux_hidden_state`` asks ``is_dflash_family()``) leaves DDTREE
  out, so SGLang never tells the target which layers to capture and hands the drafter the target's
  last hidden state, ``[N, H]`` instead of ``[N, k*H]``;
* ``hidden_none``: the target's forwards run with capture mode NULL (a capture mode that does not
  reach the target), so SGLang's logits processor returns no hidden states at all.

Two break the tree verify without breaking fluency, for the live probe's lossless check. They patch the
DDTREE plugin's round (``ddtree_runtime.sglang_plugin.round.tree_round``), not this layer's CPU pieces, so a
GPU lab layer can install them the same way (``install_verify_fault``):

* ``relaxed_accept``: at T = 0 the tree walk accepts a drafted token whose target probability is at least
  0.1, the target's first choice or not (a relaxed acceptance threshold applied to greedy requests);
* ``verify_causal_mask``: the target verifies the tree under a causal mask over its rows, so a node sees
  the siblings listed before it (a tree mask that never reached the attention backend). The lab's tiny
  target does not show it in its output (its next token depends on the current token only); a real one
  does.

``relaxed_accept`` is the lab engine's fault of the same name
(``ddtree_runtime.tiny_engine.faults``): one walk for both engines.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

from ddtree_sglang_lab_base import layer
from ddtree_sglang_lab_base.hooks import after_import
from ddtree_sglang_lab_base.layer import FAULT_ENV, UnknownFault

from ddtree_sglang_cpu_lab.seams import require

VERIFY_FAULTS = ("relaxed_accept", "verify_causal_mask")
FAULTS = ("capture_predicate", "hidden_none", *VERIFY_FAULTS)
TREE_ROUND = "ddtree_runtime.sglang_plugin.round.tree_round"

__all__ = ["FAULTS", "FAULT_ENV", "UnknownFault", "install", "install_verify_fault", "selected_fault"]


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


def _round_calls(module: ModuleType, name: str) -> None:
    """The fault replaces a module global that run_tree_round calls: refuse if it no longer does."""
    if name not in module.run_tree_round.__code__.co_names or not callable(getattr(module, name, None)):
        raise RuntimeError(f"ddtree-sglang-cpu-lab: {module.__name__}.run_tree_round no longer calls "
                           f"{name}(): re-read it and adjust the verify fault in faults.py")


def _walk_relaxed(module: ModuleType) -> None:
    from ddtree_runtime.tiny_engine.faults import relaxed_greedy_walk

    _round_calls(module, "walk_round")
    walk_round = module.walk_round

    def walk_round_relaxed(plan: Any, target_logits: Any, temperatures: Any, **kwargs: Any) -> Any:
        if temperatures is not None and bool((temperatures > 0).any()):
            return walk_round(plan, target_logits, temperatures, **kwargs)
        b, rows = plan.candidates.shape
        return relaxed_greedy_walk(plan.tree, target_logits.reshape(b, rows, -1))

    walk_round_relaxed.__wrapped__ = walk_round  # type: ignore[attr-defined]
    module.walk_round = walk_round_relaxed


def causal_custom_mask(prefix_lens: Any, rows: int) -> Any:
    """SGLang's custom_mask layout (per request a row-major bool [rows, prefix + rows], concatenated) with
    the prefix visible and the tree rows causal instead of ancestor-only."""
    import torch

    causal = torch.ones(rows, rows, dtype=torch.bool, device=prefix_lens.device).tril()
    masks = [torch.cat([torch.ones(rows, int(p), dtype=torch.bool, device=causal.device), causal], dim=1)
             for p in prefix_lens.tolist()]
    return torch.cat([m.reshape(-1) for m in masks])


def _verify_causally(module: ModuleType) -> None:
    _round_calls(module, "plan_tree_verify")
    plan_tree_verify = module.plan_tree_verify

    def plan_with_causal_mask(draft_logits: Any, root_tokens: Any, prefix_lens: Any, budget: int,
                              **kwargs: Any) -> Any:
        plan = plan_tree_verify(draft_logits, root_tokens, prefix_lens, budget, **kwargs)
        mask = causal_custom_mask(prefix_lens, plan.draft_token_num).to(plan.custom_mask.device)
        if mask.shape != plan.custom_mask.shape:
            raise RuntimeError(f"verify_causal_mask: the plan's mask has {tuple(plan.custom_mask.shape)} "
                               f"entries, the causal one {tuple(mask.shape)}: the layout moved")
        return dataclasses.replace(plan, custom_mask=mask)

    plan_with_causal_mask.__wrapped__ = plan_tree_verify  # type: ignore[attr-defined]
    module.plan_tree_verify = plan_with_causal_mask


def install_verify_fault(fault: str) -> None:
    """Patch the DDTREE round for one of VERIFY_FAULTS when the plugin's round module is imported."""
    patch = {"relaxed_accept": _walk_relaxed, "verify_causal_mask": _verify_causally}[fault]
    after_import(TREE_ROUND, patch)


def selected_fault(env: dict[str, str] | None = None) -> str | None:
    why = (f"the real-SGLang lab engine reproduces {', '.join(FAULTS)}; the other lab faults exist only in "
           "the lab engine (sglang_service_engine: lab)")
    return layer.selected_fault(FAULTS, why, env)


def install() -> None:
    fault = selected_fault()
    if fault == "capture_predicate":
        after_import(
            "sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state",
            _leave_plugins_out_of_capture,
        )
    elif fault == "hidden_none":
        after_import("sglang.srt.model_executor.model_runner", _target_forwards_capture_nothing)
    elif fault in VERIFY_FAULTS:
        install_verify_fault(fault)
