"""What a DDTREE round reads and hands to SGLang, as SGLang's ``dflash_info.py`` does for DFLASH:
the verify input SGLang's backends read (``DDTreeVerifyInput``) and the round's input taken from a
``ScheduleBatch`` (``round_input``: prefix, bonus, per-request sampling and stop tokens)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from torch import Tensor


@dataclass
class DDTreeVerifyInput(DFlashVerifyInput):
    """DFlash's verify input with the tree links SGLang's hybrid backend reads in its tree branch
    (``hybrid_linear_attn_backend.py`` ~298): ``[bs, B+1]`` local row indices, -1 = none."""

    retrieve_next_token: Tensor | None = None
    retrieve_next_sibling: Tensor | None = None


def round_input(batch: Any, bonus_tokens: Any, mask_cells: int | None = None) -> Any:
    """``RoundInput`` from a ScheduleBatch: prefix, bonus, per-request sampling and stop tokens.
    Greedy is SGLang's host flag ``is_all_greedy`` (temperatures None), never read from tensors."""
    from ddtree_runtime.sglang_plugin.round.tree_round import RoundInput

    info = batch.sampling_info
    temperatures = top_ks = top_ps = None
    if info is not None and not info.is_all_greedy:
        top_ks = info.top_ks.reshape(-1)
        # SGLang marks greedy requests with top_k <= 1 (temperature 0 becomes top_k 1).
        temperatures = torch.where(top_ks <= 1, 0.0, info.temperatures.reshape(-1).float())
        top_ps = info.top_ps.reshape(-1)
    return RoundInput(
        req_pool_indices=batch.req_pool_indices,
        prefix_lens=batch.seq_lens,
        bonus_tokens=bonus_tokens,
        temperatures=temperatures,
        top_ks=top_ks,
        top_ps=top_ps,
        stop_token_ids=tuple(stop_ids(req) for req in batch.reqs),
        mask_cells=mask_cells,
    )


def stop_ids(req: Any) -> frozenset[int]:
    """Token ids that end this request (its stop_token_ids, plus EOS unless ignore_eos)."""
    params = req.sampling_params
    ids = set(getattr(params, "stop_token_ids", None) or ())
    if not getattr(params, "ignore_eos", False):
        ids |= set(getattr(req, "eos_token_ids", None) or ())
    return frozenset(int(i) for i in ids)
