"""One DDTREE round in SGLang's tensor layout, between the drafter's logits and the KV commit.

Pure tensor code on top of ``ddtree_runtime.core.tree`` (which dispatches to the CUDA kernels on GPU):
the worker calls these with the drafter's logits and the target's verify output. SGLang's
layout conventions (EAGLE/DFlash verify inputs):

* flat rows: request ``r``'s node ``i`` is row ``r * (B + 1) + i`` of the verify forward;
* ``candidates [b, B+1]`` / ``draft_token`` (flat): root (previous bonus) then node tokens;
* ``custom_mask``: per request a row-major bool ``[B+1, prefix + B+1]``, concatenated;
* ``accept_index [b, L+1]``: flat rows of the accepted path, root first, -1 padded;
  ``accept_length [b]``: accepted draft tokens (root excluded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ddtree_runtime.core.tree import (
    DraftTopK,
    DraftTree,
    VerifyInputs,
    WalkResult,
    build_tree,
    build_tree_from_topk,
    compile_tree,
    verify_attention_mask,
    verify_attention_mask_flat,
    walk_posterior,
    write_tree_mask_cells,
)
from ddtree_runtime.core.tree_order import depth_first_order, reorder_tree


@dataclass(frozen=True)
class TreeVerifyBatch:
    tree: DraftTree
    inputs: VerifyInputs
    candidates: Tensor  # [b, B+1] int64
    draft_token: Tensor  # [b*(B+1)] int64
    positions: Tensor  # [b*(B+1)] int64
    custom_mask: Tensor  # flat bool, sum over requests of (B+1) * (prefix + B+1) (or a bound, True-padded)
    retrieve_index: Tensor  # [b, B+1]
    retrieve_next_token: Tensor  # [b, B+1]
    retrieve_next_sibling: Tensor  # [b, B+1]

    @property
    def draft_token_num(self) -> int:
        return int(self.candidates.shape[1])


@dataclass(frozen=True)
class TreeAccept:
    walk: WalkResult
    accept_index: Tensor  # [b, L+1] flat verify rows of the accepted path, -1 padded
    accept_length: Tensor  # [b] accepted draft tokens (num_accepted - 1)
    bonus: Tensor  # [b]


def draft_position_logits(block_logits: Tensor | DraftTopK, batch_size: int) -> Tensor | DraftTopK:
    """The drafter's block output ``[b * block, V]`` (slot 0 = bonus) -> per-depth logits
    ``[b, L, V]`` for depths 1..L (slots 1..block-1). A ``DraftTopK`` (a vocabulary-parallel head's
    merge) holds depths 1..L already: ``[b, L, K]``, passed through."""
    if isinstance(block_logits, DraftTopK):
        if block_logits.ids.dim() != 3 or block_logits.ids.shape[0] != batch_size:
            raise ValueError(
                f"draft top-K must be [batch, L, K] with batch {batch_size}, "
                f"got {tuple(block_logits.ids.shape)}"
            )
        return block_logits
    if block_logits.dim() != 2 or block_logits.shape[0] % batch_size:
        raise ValueError(
            f"draft block logits must be [batch * block, V] with batch {batch_size}, "
            f"got {tuple(block_logits.shape)}"
        )
    block = block_logits.shape[0] // batch_size
    return block_logits.view(batch_size, block, -1)[:, 1:, :]


def plan_tree_verify(
    draft_logits: Tensor | DraftTopK,
    root_tokens: Tensor,
    prefix_lens: Tensor,
    budget: int,
    *,
    topk_cap: int | None = None,
    mask_cells: int | None = None,
    mask_buffer: Tensor | None = None,
    depth_first: bool = False,
) -> TreeVerifyBatch:
    """Build each request's tree and the verify inputs SGLang's target forward takes, from the
    per-depth logits ``[b, L, V]`` or their top-K and logsumexp (``DraftTopK [b, L, K]``).

    ``mask_cells``: a host-side upper bound of the flat mask's size (from reserved lengths); the
    mask is then a fixed ``[mask_cells]`` tensor written at device-computed offsets and nothing is
    read back (the overlap scheduler's contract). Without it the mask is sized from the prefix
    lengths, read to the host.

    ``mask_buffer``: the target backend's own verify-mask buffer (a fixed address): only the tree
    cells are written into it, in place (``write_tree_mask_cells``; the Triton verify never reads
    the prefix cells), and ``custom_mask`` is the buffer's first ``mask_cells`` cells (the whole
    buffer without a bound). What the round's CUDA graphs use (``round_graphs``).

    ``depth_first``: the verify rows in depth-first order (``core/tree_order``), each first child right
    after its parent, for a GDN verify that keeps that parent's state in registers; the walk, the
    commit and the drafter's context follow the rows, so the tokens are the same."""
    if isinstance(draft_logits, DraftTopK):
        tree = build_tree_from_topk(draft_logits, budget, topk_cap=topk_cap)
    else:
        tree = build_tree(draft_logits, budget, topk_cap=topk_cap)
    if depth_first:
        tree = reorder_tree(tree, depth_first_order(tree.parents, tree.horizon))
    inputs = compile_tree(tree, root_tokens, prefix_lens)
    if mask_buffer is not None:
        write_tree_mask_cells(inputs, prefix_lens, mask_buffer)
        custom_mask = mask_buffer if mask_cells is None else mask_buffer[:mask_cells]
    elif mask_cells is not None:
        custom_mask = verify_attention_mask_flat(inputs, prefix_lens, mask_cells)
    else:
        custom_mask = torch.cat([m.reshape(-1) for m in verify_attention_mask(inputs, prefix_lens)])
    return TreeVerifyBatch(
        tree=tree,
        inputs=inputs,
        candidates=inputs.input_ids,
        draft_token=inputs.input_ids.reshape(-1),
        positions=inputs.positions.reshape(-1),
        custom_mask=custom_mask,
        retrieve_index=inputs.retrieve_index,
        retrieve_next_token=inputs.retrieve_next_token,
        retrieve_next_sibling=inputs.retrieve_next_sibling,
    )


def accept_from_posterior(plan: TreeVerifyBatch, posterior: Tensor) -> TreeAccept:
    """Walk with the target's decided token per verify row (``[b*(B+1)]`` or ``[b, B+1]``)."""
    b, rows = plan.candidates.shape
    walk = walk_posterior(plan.tree, posterior.reshape(b, rows))
    base = (torch.arange(b, device=walk.accepted.device) * rows).unsqueeze(1)
    accept_index = torch.where(walk.accepted >= 0, walk.accepted + base, walk.accepted)
    return TreeAccept(
        walk=walk,
        accept_index=accept_index,
        accept_length=walk.num_accepted - 1,
        bonus=walk.bonus,
    )


def accept_greedy(plan: TreeVerifyBatch, target_logits: Tensor) -> TreeAccept:
    """T = 0: ``target_logits [b*(B+1), V]`` (global vocabulary) decide each row by argmax."""
    return accept_from_posterior(plan, target_logits.argmax(dim=-1))


def gather_accepted_hidden(hidden: Tensor, accept: TreeAccept) -> Tensor:
    """The target's hidden states of the accepted rows, gathered by node index in path order
    (root first): what the drafter's context gets next. Never a contiguous prefix of the verify
    rows, which would hand the drafter the features of rejected siblings."""
    rows = accept.accept_index[accept.accept_index >= 0]  # row-major: request by request, in path order
    return hidden.index_select(0, rows)


def window_permutation(accept: TreeAccept, window: int) -> Tensor:
    """Per request, a permutation of the verify window's KV rows ``[b, window]`` that puts the
    accepted rows first, in path order, then every other row in its old order. Applied to a
    request's ``req_to_token[prefix : prefix + window]`` (page size 1) it commits the accepted
    nodes' KV at consecutive positions without copying data or leaking a slot."""
    accepted = accept.walk.accepted
    b = accepted.shape[0]
    device = accepted.device
    order = torch.arange(window, device=device).expand(b, window)
    valid = accepted >= 0
    # Sort key: accepted rows by their rank on the path, the rest after them by row index.
    # Padding entries (-1) write into a spare last column that is dropped.
    rank = torch.full((b, window + 1), window, dtype=torch.long, device=device)
    steps = torch.arange(accepted.shape[1], device=device).expand_as(accepted)
    rank.scatter_(1, torch.where(valid, accepted, window), torch.where(valid, steps, window))
    key = rank[:, :window] * (window + 1) + order
    return torch.argsort(key, dim=1)


def combine_shard_argmax(shard_max: Tensor, shard_ids: Tensor) -> Tensor:
    """``[world, N]`` per-shard maxima and their GLOBAL ids -> ``[N]`` global argmax. Ties go to
    the smallest global id, as ``argmax`` over the unsharded vocabulary does."""
    best = shard_max.max(dim=0, keepdim=True).values
    ids = torch.where(shard_max == best, shard_ids, torch.full_like(shard_ids, torch.iinfo(torch.long).max))
    return ids.min(dim=0).values


def greedy_global_ids(local_logits: Tensor, vocab_start: int, group: Any = None) -> Tensor:
    """Greedy tokens over a vocabulary-parallel head: each rank holds logits for vocabulary ids
    ``[vocab_start, vocab_start + V_local)``; the result is the GLOBAL id of the overall argmax
    (a shard-local index would silently name another token)."""
    local_max, local_arg = local_logits.float().max(dim=-1)
    global_ids = local_arg.long() + int(vocab_start)
    import torch.distributed as dist

    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return global_ids
    world = dist.get_world_size(group)
    maxes = [torch.empty_like(local_max) for _ in range(world)]
    ids = [torch.empty_like(global_ids) for _ in range(world)]
    dist.all_gather(maxes, local_max.contiguous(), group=group)
    dist.all_gather(ids, global_ids.contiguous(), group=group)
    return combine_shard_argmax(torch.stack(maxes), torch.stack(ids))
