"""A draft tree's rows in another order: depth first, each node's children in row order (in the
heap order ``tree.build_tree`` returns, the best child first), so every first child sits right after
its parent. A Gated DeltaNet tree verify keeps such a parent's state in registers
(``kernels/gdn_tree_recurrent.py``); the heap order keeps it for fewer rows.

Host loops over small trees: for benchmarks and tests. The round would need it on the GPU.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ddtree_runtime.core.tree_types import DraftTree


def depth_first_order(parents: torch.Tensor) -> torch.Tensor:
    """Per request, the rows in depth-first preorder (children in row order): ``order[:, i]`` is the
    old row at new row i, row 0 (the root) first. Padding rows (parent -1 after the root) go last."""
    orders = []
    for row in parents.tolist():
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(row[1:], start=1):
            if parent >= 0:
                children.setdefault(parent, []).append(node)
        order, stack = [], [0]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(children.get(node, [])))
        seen = set(order)
        order += [n for n in range(len(row)) if n not in seen]
        orders.append(order)
    return torch.tensor(orders, dtype=torch.long, device=parents.device)


def reorder_tree(tree: DraftTree, order: torch.Tensor) -> DraftTree:
    """The same tree with its rows in ``order`` (``depth_first_order``'s form: row 0 first)."""
    if not bool((order[:, 0] == 0).all()):
        raise ValueError("the root must stay row 0")
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
