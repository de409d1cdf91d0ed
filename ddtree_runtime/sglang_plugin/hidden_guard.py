"""The hidden-state guard on the target's forward: after every forward whose hidden states feed the
drafter, the width it observed goes to the live handshake, and a None / rank / width / row-count
mismatch raises (``ddtree_runtime.core.hidden_states``) instead of reaching the drafter."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ddtree_runtime.core.contract import HiddenContract
from ddtree_runtime.core.hidden_states import check_hidden_states
from ddtree_runtime.sglang_plugin.handshake import HandshakeState


def _captures_full(mode: Any) -> bool:
    # CaptureHiddenMode.FULL (= 2) is what feeds the drafter; NULL/LAST forwards do not.
    return mode is not None and (getattr(mode, "name", None) == "FULL" or mode == 2)


def _rows_of(batch: Any, forward_batch: Any) -> int | None:
    if forward_batch is not None and getattr(forward_batch, "input_ids", None) is not None:
        return int(forward_batch.input_ids.shape[0])
    extend_lens = getattr(batch, "extend_lens", None)
    if extend_lens is not None:
        return int(sum(extend_lens))
    return None


def guard_target_forward(
    forward: Callable[..., Any],
    contract: HiddenContract,
    handshake: HandshakeState,
    on_update: Callable[[dict[str, Any]], None] | None = None,
) -> Callable[..., Any]:
    """Wrap ``TpModelWorker.forward_batch_generation``: after every forward whose hidden states
    go to the drafter, record the observed width and check None / rank / width / row count."""

    def guarded(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        forward_batch = kwargs.get("forward_batch")
        batch = kwargs.get("batch", args[0] if args else None)
        mode = kwargs.get("capture_hidden_mode", getattr(forward_batch, "capture_hidden_mode", None))
        rows = _rows_of(batch, forward_batch)
        if not _captures_full(mode) or not rows:
            return out  # idle rank or a forward that feeds no drafter
        logits_output = getattr(out, "logits_output", None)
        hidden = getattr(logits_output, "hidden_states", None)
        handshake.observe(hidden)
        if on_update is not None:
            on_update(handshake.to_dict())
        check_hidden_states(hidden, contract, num_tokens=rows)
        return out

    guarded.__wrapped__ = forward  # type: ignore[attr-defined]
    return guarded
