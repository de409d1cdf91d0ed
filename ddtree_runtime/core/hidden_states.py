"""The live check: a target hidden tensor against the handshake, before it reaches the drafter.

The SGLang plugin's worker and tree round and the lab engine call :func:`check_hidden_states` after a
target forward that captures hidden states; :mod:`ddtree_runtime.core.contract` states the width from
the files. Duck-typed on ``shape``, ``dtype`` and ``device``: no torch import.
"""

from __future__ import annotations

from typing import Any

from ddtree_runtime.core.contract import HiddenContract
from ddtree_runtime.core.model_files import ContractError

__all__ = ["check_hidden_states"]


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _same_device(actual: Any, wanted: Any) -> bool:
    # "cuda" names whichever CUDA device; "cuda:1" names one.
    a, w = str(actual), str(wanted)
    return a == w or (":" not in w and a.split(":")[0] == w)


def check_hidden_states(
    hidden: Any,
    contract: HiddenContract,
    *,
    num_tokens: int | None = None,
    dtype: Any = None,
    device: Any = None,
) -> None:
    """Check a live target hidden tensor ``[N, capture_width]`` before it reaches the drafter."""
    width = contract.capture_width
    layers, h = len(contract.target_layer_ids), contract.target_hidden_size
    if hidden is None:
        raise ContractError(
            "hidden_states_missing",
            f"drafter expects target hidden states [N, {width}] ({layers} target layers x {h}) but got None: "
            "the target did not capture auxiliary hidden states; is the algorithm treated as DFlash-family "
            "(set_dflash_layers_to_capture, capture mode FULL)?",
            expected=width,
        )
    shape = tuple(int(s) for s in getattr(hidden, "shape", ()))
    shown = "[" + ", ".join(str(s) for s in shape) + "]"
    if len(shape) != 2:
        raise ContractError(
            "hidden_width_mismatch",
            f"drafter expects a 2-D tensor [N, {width}] ({layers} target layers x {h}) but got {shown}",
            expected=width,
            observed_shape=list(shape),
        )
    observed = shape[1]
    if observed != width:
        if observed == h:
            why = "the target captured no auxiliary layers; is the algorithm treated as DFlash-family?"
        elif observed % h == 0:
            why = (
                f"the target captured {observed // h} layers instead of {layers}; "
                "do the target_layer_ids given to the target match the drafter's?"
            )
        else:
            why = f"{observed} is not a multiple of the target hidden size {h}; wrong target model?"
        raise ContractError(
            "hidden_width_mismatch",
            f"drafter expects [N, {width}] ({layers} target layers x {h}) but got [N, {observed}]: {why}",
            expected=width,
            observed=observed,
        )
    if num_tokens is not None and shape[0] != num_tokens:
        raise ContractError(
            "hidden_width_mismatch",
            f"expected hidden states for {num_tokens} tokens [{num_tokens}, {width}] but got {shown}: "
            "the capture does not line up with the batch (tree gather index or extend lengths wrong?)",
            expected_tokens=num_tokens,
            observed_tokens=shape[0],
        )
    if dtype is not None and _dtype_name(getattr(hidden, "dtype", None)) != _dtype_name(dtype):
        raise ContractError(
            "hidden_dtype_mismatch",
            f"target hidden states are {_dtype_name(hidden.dtype)} "
            f"but the drafter runs in {_dtype_name(dtype)}",
        )
    if device is not None and not _same_device(getattr(hidden, "device", None), device):
        raise ContractError(
            "hidden_device_mismatch",
            f"target hidden states are on {hidden.device} but the drafter is on {device}",
        )
