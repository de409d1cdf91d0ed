"""DDTREE's speculative worker, on top of SGLang's DFlash spec-v2 worker.

What it adds to ``DFlashWorkerV2`` (which keeps the drafter, its KV pool, the prompt
materialisation and the CUDA graphs):

* start-up: the hidden-state width check (``ddtree_runtime.contract``); a mismatch fails the
  start instead of handing the drafter ``[N, 5120]`` where it expects ``[N, 25600]``;
* after every target forward that captures hidden states for the drafter: the None / shape
  check, and the live handshake (``/server_info``, ``sglang:ddtree_*``);
* the drafter runs its own block (``speculative_dflash_block_size``) while the target verifies
  budget + 1 tree nodes.

Decode in this release: the chain case only. A DDTREE tree with top-k cap 1 and budget
L = block - 1 is exactly DFlash's argmax chain (ddtree-algorithm.md section 7, case 4), which
``DFlashWorkerV2`` decodes with SGLang's own tested code. Wider trees need a decode loop that
feeds ``tree_step`` (tree build, tree-masked verify, walk, KV window permutation, hidden gather
by node index) into SGLang's KV pool; that loop has not been written or run on a GPU yet, so
such configurations are refused at worker start with a message saying so
(``check_decode_support``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

from ddtree_runtime.contract import ContractError, HiddenContract, check_hidden_states, load_contract
from ddtree_runtime.sglang_plugin.algorithm import published_settings, resolved_settings
from ddtree_runtime.sglang_plugin.gates import DDTreeConfigError
from ddtree_runtime.sglang_plugin.handshake import HandshakeMetrics, HandshakeState, static_handshake

logger = logging.getLogger(__name__)


def startup_contract(target_path: str, draft_path: str) -> HiddenContract | None:
    """The width check at worker start: raises ContractError when the drafter's ``fc`` does not
    take what the target captures. None when the models are not local directories (the check
    then runs on the loaded drafter, see ``check_loaded_widths``)."""
    if not (os.path.isdir(target_path) and os.path.isdir(draft_path)):
        return None
    return load_contract(target_path, draft_path)


def check_loaded_widths(target_hidden: int, layer_ids: list[int], fc_in_features: int) -> None:
    """Same check on the loaded models, for hub paths that ``startup_contract`` cannot read."""
    width = len(layer_ids) * target_hidden
    if width != fc_in_features:
        raise ContractError(
            "fc_width_mismatch",
            f"drafter fc expects [N, {fc_in_features}] but the target captures [N, {width}] "
            f"({len(layer_ids)} target layers x {target_hidden})",
            expected=fc_in_features,
            capture_width=width,
        )


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


class TreeDecodeNotAvailable(DDTreeConfigError):
    """The configuration needs the tree decode loop, which this release does not have."""


def check_decode_support(settings: dict[str, Any]) -> None:
    budget, block, cap = settings["budget"], settings["block_size"], settings["topk_cap"]
    if cap == 1 and budget == block - 1:
        return
    raise TreeDecodeNotAvailable(
        f"DDTREE with budget {budget} and top-k cap {cap} verifies a tree, and this release of "
        "ddtree-runtime has no GPU decode loop for trees yet (tree build, masked verify, walk and "
        "KV commit are implemented and tested on CPU in ddtree_runtime.sglang_plugin.tree_step, "
        "but not wired into SGLang's KV pool). What starts today: "
        f"--speculative-ddtree-topk-cap 1 --speculative-ddtree-budget {block - 1} (the chain "
        "special case, decoded exactly like DFLASH, with DDTREE's guards and handshake), or "
        "--speculative-algorithm DFLASH."
    )


class DDTreeWorker(DFlashWorkerV2):
    """DFlash drafter + DDTREE tree verify (see module docstring)."""

    def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, target_worker: Any) -> None:
        settings = resolved_settings(server_args) or published_settings()
        if settings is None:
            raise DDTreeConfigError(
                "DDTreeWorker started without DDTREE's resolved settings: was the server started "
                "with --speculative-algorithm DDTREE and the ddtree plugin loaded (SGLANG_PLUGINS)?"
            )
        self.ddtree_settings = settings
        from sglang.srt.arg_groups.overrides import resolving_view

        cfg = resolving_view(server_args)
        contract = startup_contract(str(cfg.model_path), str(cfg.speculative_draft_model_path))
        check_decode_support(settings)
        self._ddtree_contract = contract
        base = static_handshake({**settings, "contract": contract.to_dict() if contract else None})
        self._ddtree_handshake = HandshakeState(base)
        self._ddtree_metrics = HandshakeMetrics() if cfg.enable_metrics else None
        if contract is not None:
            target_worker.forward_batch_generation = guard_target_forward(
                target_worker.forward_batch_generation, contract, self._ddtree_handshake, self._publish
            )
        self._publish(self._ddtree_handshake.to_dict())
        super().__init__(server_args, gpu_id, nccl_port, target_worker)

    def _publish(self, handshake: dict[str, Any]) -> None:
        if self._ddtree_metrics is not None:
            self._ddtree_metrics.update(handshake)

    def ddtree_handshake(self) -> dict[str, Any]:
        return self._ddtree_handshake.to_dict()
