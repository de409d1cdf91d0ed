"""A draft tree's rows in another order: depth first, each node's children in row order (in the
heap order ``tree.build_tree`` returns, the best child first), so every first child sits right after
its parent. A Gated DeltaNet tree verify keeps such a parent's state in registers
(``kernels/gdn_tree_recurrent.py``); the heap order keeps it for fewer rows.

Tensor operations at fixed shapes (a loop over depths, no host read), so the round can run it on the
GPU inside its graphs.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ddtree_runtime.core.tree_types import DraftTree


def depth_first_order(parents: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """Per request, the rows in depth-first preorder (children in row order): ``order[:, i]`` is the
    old row at new row i, row 0 (the root) first. Padding rows (parent -1 after the root) go last,
    in order. ``max_depth`` (the tree's horizon) bounds the loops over levels, else ``n - 1``."""
    b, n = parents.shape
    device = parents.device
    real = parents >= 0
    real[:, 0] = True
    safe_parent = parents.clamp(min=0)
    levels = n - 1 if max_depth is None else min(max_depth, n - 1)
    depth = torch.zeros_like(parents)
    for _ in range(levels):  # a row's depth is its parent's + 1, settled one level per pass
        depth = torch.where(parents >= 0, depth.gather(1, safe_parent) + 1, depth)
    # Subtree sizes, bottom up: a row adds its size to its parent's once its own level is done.
    size = real.long()
    for level in range(levels, 0, -1):
        at = (depth == level) & real & (parents >= 0)
        size = size.scatter_add(1, safe_parent, torch.where(at, size, torch.zeros_like(size)))
    # Sizes of the earlier siblings of each row (same parent, lower row).
    rows = torch.arange(n, device=device)
    earlier = (rows[None, :] < rows[:, None])[None]  # [1, v, s]: s before v
    siblings = (parents[:, :, None] == parents[:, None, :]) & real[:, None, :] & (parents[:, :, None] >= 0)
    before = ((siblings & earlier) * size[:, None, :]).sum(-1)
    # Preorder positions, top down.
    pos = torch.zeros_like(parents)
    for _ in range(levels):
        pos = torch.where(parents >= 0, pos.gather(1, safe_parent) + 1 + before, pos)
    # Padding rows after every real row, in row order.
    pad = ~real
    pos = torch.where(pad, real.sum(1, keepdim=True) + torch.cumsum(pad.long(), 1) - 1, pos)
    return torch.empty_like(pos).scatter_(1, pos, rows.expand(b, n).contiguous())


def reorder_tree(tree: DraftTree, order: torch.Tensor) -> DraftTree:
    """The same tree with its rows in ``order`` (``depth_first_order``'s form: row 0 first). Not
    checked here: a check would read the device, and the round runs this inside a CUDA graph."""
    new_row_of = torch.argsort(order, dim=1)  # old row -> new row
    old_parents = tree.parents.gather(1, order)
    parents = torch.where(old_parents >= 0, new_row_of.gather(1, old_parents.clamp(min=0)), old_parents)
    nodes = (order[:, 1:] - 1).clamp(min=0)  # node columns (row - 1) in the new order
    return replace(
        tree,
        tokens=tree.tokens.gather(1, nodes),
        depths=tree.depths.gather(1, nodes),
        scores=tree.scores.gather(1, nodes),
        parents=parents,
    )
