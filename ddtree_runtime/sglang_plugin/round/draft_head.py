"""The drafter's per-depth distribution from the target's LM head, as SGLang 0.5.23 holds it.

DFlash's drafter has no head of its own; it borrows the target's ``lm_head`` (a ``ParallelLMHead``).
Where this rank holds the whole vocabulary (TP 1, or a replicated head) the tree ranks the fp32
logits itself, as it always did. Under vocabulary parallelism a rank's weight holds
``shard_indices``' rows: real rows ``[0, num_org_elements)`` for the ids from
``org_vocab_start_index``, then padding, then added-vocabulary rows, which are not ranked (as in
every DDTree port). ``ddtree_runtime.core.tp_head`` ranks the real rows and exchanges top-K +
logsumexp over the TP group: ``[N, 2K + 1]`` fp32 instead of a ``[N, V]`` all-reduce.

Duck-typed on SGLang's objects (the head's ``weight`` and ``shard_indices``, the group's
``world_size`` and ``all_gather_into_tensor``), so it imports nothing of SGLang itself.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ddtree_runtime.core.tp_head import VocabShard, sharded_topk
from ddtree_runtime.core.tree_types import DraftTopK, topk_width


def lm_head_shard(lm_head: Any, vocab_size: int) -> VocabShard:
    """This rank's real vocabulary rows of a (possibly vocabulary-parallel) LM head."""
    shard = getattr(lm_head, "shard_indices", None)
    if shard is None:
        return VocabShard(0, min(int(lm_head.weight.shape[0]), vocab_size), vocab_size)
    return VocabShard(int(shard.org_vocab_start_index), int(shard.num_org_elements), vocab_size)


def draft_head(
    hidden: Tensor, lm_head: Any, vocab_size: int, tp_group: Any, *, budget: int, topk_cap: int | None
) -> Tensor | DraftTopK:
    """``hidden [N, H]`` (the drafter's depth rows) -> fp32 logits ``[N, V]`` where this rank
    holds the whole vocabulary, else the merged :class:`DraftTopK` ``[N, K]`` (the same on every
    rank of ``tp_group``), K = min(budget, V, top-k cap)."""
    weight = lm_head.weight
    shard = lm_head_shard(lm_head, vocab_size)
    local = torch.matmul(hidden.to(weight.dtype), weight[: shard.num].t()).float()
    if shard.whole:
        return local
    world = 1 if tp_group is None else int(tp_group.world_size)
    if world == 1:
        raise ValueError(
            f"the LM head holds vocabulary ids [{shard.start}, {shard.start + shard.num}) of "
            f"{vocab_size} but the TP group has one rank: the other ids are nowhere; the head's "
            "shard_indices and the TP group disagree (start the server with one --tp-size for both)"
        )
    k = topk_width(budget, vocab_size, topk_cap)
    return sharded_topk(local, shard, k, world=world, all_gather=tp_group.all_gather_into_tensor)
