"""A draft tree reordered depth first (``core/tree_order``): the same tree (every node's token path
from the root), parents before children, a greedy walk emitting the same tokens, and more rows
whose parent is the row before them than the heap order has."""

from __future__ import annotations

import torch

from ddtree_runtime.core.kernels.gdn_tree_recurrent import parent_is_previous_fraction
from ddtree_runtime.core.tree import build_tree, walk_greedy
from ddtree_runtime.core.tree_order import depth_first_order, reorder_tree


def _paths(tree) -> list[set[tuple[int, ...]]]:
    out = []
    for b in range(tree.tokens.shape[0]):
        parents, tokens = tree.parents[b].tolist(), tree.tokens[b].tolist()
        paths = set()
        for row in range(1, len(parents)):
            if parents[row] < 0:
                continue
            path, node = [], row
            while node > 0:
                path.append(tokens[node - 1])
                node = parents[node]
            paths.add(tuple(reversed(path)))
        out.append(paths)
    return out


def _tree(sharpness: float, budget: int = 15, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return build_tree(torch.randn(6, 8, 50, generator=g) * sharpness, budget)


def test_depth_first_keeps_the_tree_and_puts_parents_first() -> None:
    tree = _tree(4.0)
    order = depth_first_order(tree.parents)
    again = reorder_tree(tree, order)
    rows = torch.arange(again.parents.shape[1])
    real = again.parents[:, 1:] >= 0
    assert bool((again.parents[:, 1:][real] < rows[1:].expand_as(real)[real]).all())
    assert _paths(again) == _paths(tree)
    # the depth of every row is its parent's plus one
    depth_of_row = torch.cat([torch.zeros(6, 1, dtype=torch.long), again.depths], dim=1)
    parent_depth = depth_of_row.gather(1, again.parents[:, 1:].clamp(min=0))
    assert bool((again.depths[real] == parent_depth[real] + 1).all())


def test_each_first_child_follows_its_parent() -> None:
    for sharpness in (2.0, 4.0, 8.0):
        tree = _tree(sharpness, seed=1)
        again = reorder_tree(tree, depth_first_order(tree.parents))
        heap, first = parent_is_previous_fraction(tree.parents), parent_is_previous_fraction(again.parents)
        assert first >= heap
        # rows after the first whose parent has them as its first child = rows with a child, minus the root
        parents = again.parents
        internal = sum(len({p for p in row[1:] if p >= 0}) for row in parents.tolist())
        real = int((parents[:, 1:] >= 0).sum())
        assert first == internal / real


def test_a_greedy_walk_emits_the_same_tokens_in_either_order() -> None:
    tree = _tree(3.0, seed=2)
    order = depth_first_order(tree.parents)
    again = reorder_tree(tree, order)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, tree.parents.shape[1], 50, generator=g)
    # make the target agree with part of the tree: each node's logits favour its first child's token
    for b in range(6):
        for row, parent in enumerate(tree.parents[b].tolist()):
            if row > 0 and parent >= 0 and row % 2:
                logits[b, parent, tree.tokens[b, row - 1]] += 50.0
    want = walk_greedy(tree, logits)
    got = walk_greedy(again, logits.gather(1, order[:, :, None].expand_as(logits)))
    assert torch.equal(got.emitted, want.emitted) and torch.equal(got.num_accepted, want.num_accepted)
    assert bool((want.num_accepted > 1).any())  # something was accepted: the test can tell


def test_padding_rows_stay_last() -> None:
    parents = torch.tensor([[-1, 0, 0, 1, -1, -1]])
    assert depth_first_order(parents).tolist() == [[0, 1, 3, 2, 4, 5]]


def _host_order(parents: torch.Tensor) -> torch.Tensor:
    """The plain recursion: preorder with children in row order, padding last."""
    orders = []
    for row in parents.tolist():
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(row[1:], start=1):
            if parent >= 0:
                children.setdefault(parent, []).append(node)

        def visit(node: int, children: dict[int, list[int]] = children) -> list[int]:
            return [node] + [m for child in children.get(node, []) for m in visit(child)]

        order = visit(0)
        orders.append(order + [r for r in range(len(row)) if r not in order])
    return torch.tensor(orders)


def test_the_tensor_order_is_the_plain_recursions() -> None:
    for seed, (sharpness, budget) in enumerate([(1.0, 7), (3.0, 15), (6.0, 31), (12.0, 63), (0.5, 64)]):
        tree = _tree(sharpness, budget, seed=seed)
        want = _host_order(tree.parents)
        assert torch.equal(depth_first_order(tree.parents), want)
        assert torch.equal(depth_first_order(tree.parents, max_depth=tree.horizon), want)
    few = _tree(3.0, 15, seed=9)
    few.parents[:, 12:] = -1  # padding rows in the middle of nothing: fewer nodes than the budget
    assert torch.equal(depth_first_order(few.parents, max_depth=few.horizon), _host_order(few.parents))
