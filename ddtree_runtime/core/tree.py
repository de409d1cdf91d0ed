"""The DDTree round as batched PyTorch: build the draft tree, compile verify inputs, walk, commit.

Shapes: ``b`` requests, ``L`` draft horizon (block_size - 1), ``V`` vocabulary, ``B`` budget
(non-root nodes). Node 0 is the root (the previous bonus token); nodes 1..B come in best-first
(heap pop) order of ddtree-algorithm.md section 2, so every tensor has a static shape for a given
``(b, B)`` and the result is comparable node for node with the public reference.

Every public function runs on any device. On CUDA, when ``ddtree_runtime.core.kernels.available()``
says so and ``DDTREE_DISABLE_KERNELS`` is not ``"1"``, the call goes to the kernel of the same
name instead. The result types live in ``tree_types`` (shared with the kernels, which never
import this module).
"""

from __future__ import annotations

import functools
import heapq
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ddtree_runtime.core.tree_types import (
    CommitPlan,
    DraftTopK,
    DraftTree,
    VerifyInputs,
    WalkResult,
    check_build_inputs,
    check_rows,
    check_topk_inputs,
    empty_tree,
    topk_width,
)

__all__ = [
    "CommitPlan",
    "DraftTopK",
    "DraftTree",
    "VerifyInputs",
    "WalkResult",
    "build_tree",
    "build_tree_from_topk",
    "commit_plan",
    "compile_tree",
    "stable_topk",
    "topk_log_probs",
    "verify_attention_mask",
    "verify_attention_mask_flat",
    "walk_greedy",
    "walk_posterior",
    "walk_sample",
    "write_tree_mask_cells",
]

# Log-probs of -inf (masked vocabulary) are clamped to this in the fp64 ordering scores so that sums
# stay finite and comparable; the reported fp32 scores still read -inf.
_LOG_PROB_FLOOR = -1e300


# --------------------------------------------------------------------------------------------
# Kernel dispatch


def _kernel_for(name: str, tensor: Any) -> Callable[..., Any] | None:
    """The CUDA kernel of the same name when it should run for ``tensor``, else None."""
    if not getattr(tensor, "is_cuda", False) or os.environ.get("DDTREE_DISABLE_KERNELS") == "1":
        return None
    try:
        from ddtree_runtime.core import kernels
    except ImportError:
        return None
    if not kernels.available():
        return None
    return getattr(kernels, name, None)


# --------------------------------------------------------------------------------------------
# Build


def topk_log_probs(draft_logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-``k`` fp32 log-probabilities per depth over the FULL vocabulary, sorted descending.

    The order is (logit descending, token id ascending), also at the cut: among tokens tied
    with the k-th logit the lowest ids are taken. That is log-prob order, except where two logits
    an ulp apart round to one fp32 log-prob; whether they do depends on the last bit of the row's
    log(sum), which the kernel's chunks and a TP head's shards add up in other orders, so ranking
    by the rounded log-prob made the ids depend on the path. The log-probs stay non-increasing.
    Ranks (and thus the tree) are deterministic whatever ``torch.topk`` does with ties.
    """
    x = draft_logits.float()
    _, ids = stable_topk(x, k)
    return torch.log_softmax(x, dim=-1).gather(-1, ids), ids


def stable_topk(values: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The top-``k`` of ``values [..., n]`` and their indices in the order (value descending, index
    ascending), also at the cut (see :func:`topk_log_probs`)."""
    kth = torch.topk(values, k, dim=-1, largest=True, sorted=True).values[..., -1:]
    above = values > kth
    tied = values == kth
    room = k - above.sum(dim=-1, keepdim=True)
    selected = above | (tied & (torch.cumsum(tied, dim=-1) <= room))
    # NaN selects fewer than k. An asynchronous assert: on CUDA a device-side check, not a host read.
    torch._assert_async(
        (selected.sum(dim=-1) == k).all(), "draft_logits contain NaN: cannot rank the draft tokens"
    )
    # The k selected ids in ascending order, without a host read (``nonzero`` would sync the
    # device): the largest keys n - id are the selected ids, smallest first.
    n = values.shape[-1]
    key = torch.where(selected, n - torch.arange(n, device=values.device), 0)
    ids = torch.topk(key, k, dim=-1, largest=True, sorted=True).indices
    top = values.gather(-1, ids)
    by_value = torch.argsort(-top, dim=-1, stable=True)
    return top.gather(-1, by_value), ids.gather(-1, by_value)


def _score_dtype(device: torch.device) -> torch.dtype:
    # fp64 sums of fp32 log-probs are exact in practice, so the order does not depend on the
    # summation path (the reference sums in Python floats). MPS has no fp64.
    return torch.float32 if device.type == "mps" else torch.float64


def build_tree(draft_logits: Tensor, budget: int, *, topk_cap: int | None = None) -> DraftTree:
    """Best-first DDTree of ``budget`` nodes per request from draft logits ``[b, L, V]``.

    Node set = the ``budget`` most probable prefixes under the product of per-depth marginals
    (top-K per depth, K = min(budget, V, topk_cap)); node order = the reference heap's pop order:
    by score descending, ties by the ranks tuple (lexicographic, a prefix first).

    How, without a heap: the depth-d nodes of the final tree are among the best ``budget - d + 1``
    children of the kept depth-(d-1) nodes, so one stable sort per depth over the candidates
    (pruned to those with fewer than ``budget - d + 1`` certainly-better rivals) finds them; a
    last stable sort of all kept nodes (arranged in ranks-lexicographic = preorder order) by
    score gives the final order. Scores are compared as fp64 sums of the fp32 log-probs, which
    are exact for real log-prob ranges, so the order does not depend on how a score was summed
    (the reference heap sums in Python floats along another path).
    """
    check_build_inputs(draft_logits, topk_cap)
    kernel = _kernel_for("build_tree", draft_logits)
    # Shapes the build kernel does not cover (long horizons, very wide top-K) take the plain path.
    if kernel is not None:
        from ddtree_runtime.core import kernels

        if kernels.supports_build(draft_logits.shape[1], budget, draft_logits.shape[2], topk_cap):
            return kernel(draft_logits, budget, topk_cap=topk_cap)
    b, horizon, vocab = draft_logits.shape
    budget = max(int(budget), 0)
    device = draft_logits.device
    if budget == 0 or horizon == 0 or vocab == 0:
        return empty_tree(b, budget, horizon, device)

    top_lp, top_ids = topk_log_probs(draft_logits, topk_width(budget, vocab, topk_cap))  # [b, L, K]
    return _build_from_topk(top_lp, top_ids, budget)


def build_tree_from_topk(top: DraftTopK, budget: int, *, topk_cap: int | None = None) -> DraftTree:
    """:func:`build_tree` from the per-depth top-K lists ``[b, L, K]`` instead of the logits: the
    same tree, node for node, when ``top`` holds what :func:`topk_log_probs` gives for the full
    vocabulary (a vocabulary-parallel head merges it without ever holding ``[b, L, V]``).

    K = min(top.k, budget, topk_cap): ``top`` may carry more candidates than the tree can use.
    """
    check_topk_inputs(top, topk_cap)
    b, horizon, width = top.ids.shape
    budget = max(int(budget), 0)
    k = topk_width(budget, width, topk_cap)
    if budget == 0 or horizon == 0 or k == 0:
        return empty_tree(b, budget, horizon, top.ids.device)
    top_lp, top_ids = top.log_probs[..., :k], top.ids[..., :k]
    kernel = _kernel_for("build_tree_from_topk", top_lp)
    if kernel is not None:
        from ddtree_runtime.core import kernels

        if kernels.supports_build(horizon, k, k):  # the rule build_tree follows for its kernel
            return kernel(DraftTopK(top_lp, top_ids, top.logsumexp), budget)
    return _build_from_topk(top_lp, top_ids, budget)


def _build_from_topk(top_lp: Tensor, top_ids: Tensor, budget: int) -> DraftTree:
    """The plain path's build (see :func:`build_tree`) from top-K ``[b, L, K]``, K >= 1, budget >= 1."""
    b, horizon, k = top_lp.shape
    device = top_lp.device
    sdt = _score_dtype(device)
    lp64 = top_lp.to(sdt).clamp(min=_LOG_PROB_FLOOR if sdt == torch.float64 else -1e30)

    # Per depth, the kept nodes in ranks-lexicographic order: score, parent position, rank.
    level_scores: list[Tensor] = []
    level_parent: list[Tensor] = []
    level_rank: list[Tensor] = []
    prev_scores = torch.zeros(b, 1, dtype=sdt, device=device)  # the root
    prev_by_key = torch.zeros(b, 1, dtype=torch.long, device=device)  # lex positions, best first
    for d in range(horizon):
        cap = budget - d  # at most B - d + 1 nodes at 1-based depth d + 1
        if cap <= 0:
            break
        # Only children (j-th best parent, rank r) with (j+1)(r+1) <= cap can make the cut: that
        # many candidates (better parents x better ranks) beat them. ~cap*ln(cap) of them.
        j_idx, r_idx = _candidate_grid(cap, prev_scores.shape[1], k, device)
        m = j_idx.numel()
        parent_lex = prev_by_key[:, j_idx]  # [b, M]
        cand = prev_scores.gather(1, parent_lex) + lp64[:, d, r_idx]
        lex_id = parent_lex * k + r_idx  # ascending = ranks-lexicographic order
        by_lex = torch.argsort(lex_id, dim=-1, stable=True)
        by_key = by_lex.gather(1, torch.argsort(-cand.gather(1, by_lex), dim=-1, stable=True))
        best = by_key[:, : min(cap, m)]  # candidate indices, best first
        chosen, to_key = torch.sort(lex_id.gather(1, best), dim=-1)  # the level in lex order
        level_scores.append(cand.gather(1, best).gather(1, to_key))
        level_parent.append(torch.div(chosen, k, rounding_mode="floor"))
        level_rank.append(chosen % k)
        prev_scores = level_scores[-1]
        prev_by_key = torch.argsort(to_key, dim=-1)  # key rank -> lex position

    preorder = _preorder_index(level_parent)
    scores = torch.cat(level_scores, dim=1)  # [b, N], levels concatenated
    total = scores.shape[1]
    # Arrange every kept node at its preorder slot, then a stable sort by score gives heap order.
    flat_ids = torch.arange(total, device=device).expand(b, total)
    by_pre = torch.empty_like(flat_ids).scatter_(1, preorder, flat_ids)
    order = torch.argsort(-scores.gather(1, by_pre), dim=-1, stable=True)
    picked = by_pre.gather(1, order)[:, :budget]  # flat ids in pop order
    n = picked.shape[1]

    depth_of, parent_flat, token_flat = _flat_node_fields(level_parent, level_rank, top_ids, k)
    node_of_flat = torch.full((b, total + 1), -1, dtype=torch.long, device=device)
    node_of_flat[:, total] = 0  # the root's flat id is `total`
    node_of_flat.scatter_(1, picked, torch.arange(1, n + 1, device=device).expand(b, n))

    tokens = token_flat.gather(1, picked)
    depths = depth_of.expand(b, total).gather(1, picked)
    parents = node_of_flat.gather(1, parent_flat.gather(1, picked))
    node_scores = scores.gather(1, picked).float()
    if n < budget:  # fewer prefixes than the budget: pad (uniform across the batch)
        pad = budget - n
        tokens = torch.cat([tokens, tokens.new_full((b, pad), -1)], dim=1)
        depths = torch.cat([depths, depths.new_zeros((b, pad))], dim=1)
        parents = torch.cat([parents, parents.new_full((b, pad), -1)], dim=1)
        node_scores = torch.cat([node_scores, node_scores.new_full((b, pad), float("-inf"))], dim=1)
    root_parent = torch.full((b, 1), -1, dtype=torch.long, device=device)
    return DraftTree(
        tokens=tokens,
        depths=depths,
        parents=torch.cat([root_parent, parents], dim=1),
        scores=node_scores,
        num_nodes=torch.full((b,), n, dtype=torch.long, device=device),
        horizon=horizon,
    )


@functools.lru_cache(maxsize=512)
def _candidate_grid(cap: int, width: int, k: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """All (j, r) with j < width, r < k and (j + 1) * (r + 1) <= cap, j-major (cached, read-only)."""
    j = torch.arange(min(width, cap), device=device)
    counts = torch.clamp(torch.div(cap, j + 1, rounding_mode="floor"), max=k)
    j_idx = torch.repeat_interleave(j, counts)
    starts = torch.cumsum(counts, 0) - counts
    r_idx = torch.arange(j_idx.numel(), device=device) - torch.repeat_interleave(starts, counts)
    return j_idx, r_idx


def _preorder_index(level_parent: list[Tensor]) -> Tensor:
    """Preorder position (children in rank order) of every kept node, levels concatenated.

    Preorder of a prefix-closed set of rank tuples is exactly their lexicographic order with a
    prefix first, i.e. the reference heap's tie-break.
    """
    levels = len(level_parent)
    sizes: list[Tensor] = [torch.ones_like(p) for p in level_parent]
    for d in range(levels - 1, 0, -1):  # subtree sizes, bottom-up
        sizes[d - 1] = sizes[d - 1].scatter_add(1, level_parent[d], sizes[d])
    pre: list[Tensor] = []
    parent_pre = torch.full_like(level_parent[0][:, :1], -1)  # the root
    for d in range(levels):
        parent = level_parent[d]
        excl = torch.cumsum(sizes[d], dim=1) - sizes[d]  # sizes of all earlier nodes at this level
        # Siblings are contiguous, so earlier siblings' sizes = excl - excl at the group's start.
        group_start = torch.full_like(parent_pre, torch.iinfo(torch.long).max)
        group_start = group_start.scatter_reduce(1, parent, excl, reduce="amin", include_self=True)
        pre.append(parent_pre.gather(1, parent) + 1 + excl - group_start.gather(1, parent))
        parent_pre = pre[-1]
    return torch.cat(pre, dim=1)


def _flat_node_fields(
    level_parent: list[Tensor], level_rank: list[Tensor], top_ids: Tensor, k: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Depth, parent flat id (root = total) and token of every kept node, levels concatenated."""
    offsets = [0]
    for p in level_parent:
        offsets.append(offsets[-1] + p.shape[1])
    total = offsets[-1]
    depth_parts, parent_parts, token_parts = [], [], []
    for d, (parent, rank) in enumerate(zip(level_parent, level_rank, strict=True)):
        depth_parts.append(torch.full((1, parent.shape[1]), d + 1, dtype=torch.long, device=parent.device))
        parent_parts.append(parent + offsets[d - 1] if d > 0 else torch.full_like(parent, total))
        token_parts.append(top_ids[:, d].gather(1, rank))
    return torch.cat(depth_parts, 1), torch.cat(parent_parts, 1), torch.cat(token_parts, 1)


def _reference_build_tree(
    top_lp: list[list[float]], top_ids: list[list[int]], budget: int
) -> tuple[list[int], list[int], list[int], list[float]]:
    """The literal best-first heap of ddtree-algorithm.md section 2, for ONE request.

    Takes the per-depth top-K log-probs/ids (as from :func:`topk_log_probs`) and returns
    (tokens, depths, parents incl. root, scores) in pop order. Slow, plain Python: the oracle the
    batched :func:`build_tree` and the CUDA kernels are tested against.
    """
    horizon = len(top_lp)
    if budget <= 0 or horizon == 0 or not top_lp[0]:
        return [], [], [-1], []
    k = len(top_lp[0])
    tokens: list[int] = []
    depths: list[int] = []
    parents = [-1]
    scores: list[float] = []
    first = float(top_lp[0][0])
    heap: list[tuple[float, tuple[int, ...], int, int, int, float]] = [(-first, (0,), 0, 1, 0, first)]
    while heap and len(tokens) < budget:
        _, ranks, parent, depth, rank, score = heapq.heappop(heap)
        tokens.append(int(top_ids[depth - 1][rank]))
        depths.append(depth)
        parents.append(parent)
        scores.append(score)
        index = len(tokens)
        if rank + 1 < k:
            sib = score - float(top_lp[depth - 1][rank]) + float(top_lp[depth - 1][rank + 1])
            heapq.heappush(heap, (-sib, (*ranks[:-1], rank + 1), parent, depth, rank + 1, sib))
        if depth < horizon:
            child = score + float(top_lp[depth][0])
            heapq.heappush(heap, (-child, (*ranks, 0), index, depth + 1, 0, child))
    return tokens, depths, parents, scores


# --------------------------------------------------------------------------------------------
# Compile


def _ancestor_matrix(parents: Tensor, max_depth: int | None = None) -> Tensor:
    """[b, N, N] bool, row i = ancestors of i and i itself (pointer chasing, one step per depth).

    A fixed number of steps (``max_depth``, else N) and no boolean selection: no host read."""
    b, n = parents.shape
    device = parents.device
    vis = torch.eye(n, dtype=torch.bool, device=device).expand(b, n, n).clone()
    cur = parents.clone()
    for _ in range(n if max_depth is None else min(max_depth, n)):
        live = cur >= 0
        # Dead rows write their own diagonal (already True) instead of being selected out.
        col = torch.where(live, cur, torch.arange(n, device=device).expand(b, n))
        vis.scatter_(2, col.unsqueeze(2), True)
        cur = torch.where(live, parents.gather(1, cur.clamp(min=0)), cur)
    return vis


def _child_links(parents: Tensor) -> tuple[Tensor, Tensor]:
    """First child and next sibling (local indices, pop order, -1 when none) per node."""
    b, n = parents.shape
    device = parents.device
    idx = torch.arange(n, device=device).expand(b, n)
    big = torch.full((b, n + 1), n, dtype=torch.long, device=device)
    slot = torch.where(parents >= 0, parents, torch.full_like(parents, n))  # orphans -> dump slot n
    first = big.scatter_reduce(1, slot, idx, reduce="amin", include_self=True)[:, :n]
    first_child = torch.where(first < n, first, torch.full_like(first, -1))
    # Nodes sorted by (parent, index): a node's next sibling is its successor in that order.
    key = slot * (n + 1) + idx
    order = torch.argsort(key, dim=1)
    sorted_slot = slot.gather(1, order)
    same = torch.zeros_like(order, dtype=torch.bool)
    same[:, :-1] = (sorted_slot[:, 1:] == sorted_slot[:, :-1]) & (sorted_slot[:, :-1] < n)
    nxt_sorted = torch.full_like(order, -1)
    nxt_sorted[:, :-1] = torch.where(same[:, :-1], order[:, 1:], nxt_sorted[:, :-1])
    next_sibling = torch.full_like(order, -1).scatter_(1, order, nxt_sorted)
    return first_child, next_sibling


def compile_tree(tree: DraftTree, root_tokens: Tensor, prefix_lens: Tensor) -> VerifyInputs:
    """Verify inputs for a batch: ids, positions (prefix + depth), visibility, SGLang retrieve arrays.

    ``root_tokens [b]`` are the previous round's bonus tokens, ``prefix_lens [b]`` the committed
    lengths (the target KV length), which may differ per request.
    """
    kernel = _kernel_for("compile_tree", tree.tokens)
    if kernel is not None:
        return kernel(tree, root_tokens, prefix_lens)
    b, budget = tree.tokens.shape
    device = tree.tokens.device
    root_tokens = torch.as_tensor(root_tokens, device=device).long().reshape(b, 1)
    prefix = torch.as_tensor(prefix_lens, device=device).long().reshape(b, 1)
    input_ids = torch.cat([root_tokens, tree.tokens.clamp(min=0)], dim=1)
    positions = prefix + torch.cat([torch.zeros_like(root_tokens), tree.depths], dim=1)
    first_child, next_sibling = _child_links(tree.parents)
    rows = budget + 1
    return VerifyInputs(
        input_ids=input_ids,
        positions=positions,
        visibility=_ancestor_matrix(tree.parents, tree.horizon),
        retrieve_index=torch.arange(b * rows, device=device).reshape(b, rows),
        retrieve_next_token=first_child,
        retrieve_next_sibling=next_sibling,
    )


def verify_attention_mask(inputs: VerifyInputs, prefix_lens: Tensor) -> list[Tensor]:
    """Per request bool ``[B+1, prefix+B+1]`` (True = may attend): prefix all visible, then the tree.

    This is SGLang's ``custom_mask`` layout before flattening; ``torch.cat([m.flatten() for m in
    masks])`` gives the flat buffer.
    """
    kernel = _kernel_for("verify_attention_mask", inputs.visibility)
    if kernel is not None:
        return kernel(inputs, prefix_lens)
    rows = inputs.visibility.shape[1]
    masks = []
    for i, plen in enumerate(torch.as_tensor(prefix_lens).reshape(-1).tolist()):
        prefix = torch.ones((rows, int(plen)), dtype=torch.bool, device=inputs.visibility.device)
        masks.append(torch.cat([prefix, inputs.visibility[i]], dim=1))
    return masks


def verify_attention_mask_flat(inputs: VerifyInputs, prefix_lens: Tensor, cells: int) -> Tensor:
    """:func:`verify_attention_mask`'s masks flattened and concatenated, as a fixed ``[cells]``
    bool tensor: request r's ``[B+1, prefix_r + B+1]`` block starts at the exclusive cumsum of the
    blocks before it, computed on the device (as SGLang's Triton backend computes ``mask_indptr``
    from ``seq_lens``). ``cells`` is a host-side upper bound of the total (from reserved lengths),
    so nothing is read back; cells past the real total stay True and are never read."""
    vis = inputs.visibility
    b, rows, _ = vis.shape
    device = vis.device
    prefix = torch.as_tensor(prefix_lens, device=device).long().reshape(b)
    width = prefix + rows  # [b] row length of each request's block
    start = torch.cumsum(rows * width, 0) - rows * width  # [b] block offsets
    r = torch.arange(rows, device=device)
    # Cell (i, prefix + j) of request q: start_q + i * width_q + prefix_q + j.
    row_start = start.view(b, 1, 1) + r.view(1, rows, 1) * width.view(b, 1, 1)
    at = row_start + prefix.view(b, 1, 1) + r.view(1, 1, rows)
    flat = torch.ones(cells, dtype=torch.bool, device=device)
    return flat.scatter_(0, at.reshape(-1), vis.reshape(-1))


def write_tree_mask_cells(inputs: VerifyInputs, prefix_lens: Tensor, buffer: Tensor) -> Tensor:
    """Write only the tree cells of :func:`verify_attention_mask_flat`'s layout into ``buffer`` (a
    flat bool/uint8 tensor that holds the whole batch), in place, and return it. The prefix cells are
    left as they are: SGLang's Triton verify never reads them (``skip_prefix_custom_mask``, the
    prefix is all visible), so a round writes ``b * (B+1)^2`` cells instead of the whole mask, at
    offsets computed on the device, into a buffer whose address does not change (a CUDA graph can
    hold it). A reader that does read the prefix cells (torch_native) needs the full mask."""
    vis = inputs.visibility
    b, rows, _ = vis.shape
    prefix = torch.as_tensor(prefix_lens, device=vis.device).long().reshape(b)
    width = prefix + rows
    start = torch.cumsum(rows * width, 0) - rows * width
    r = torch.arange(rows, device=vis.device)
    row_start = start.view(b, 1, 1) + r.view(1, rows, 1) * width.view(b, 1, 1)
    at = row_start + prefix.view(b, 1, 1) + r.view(1, 1, rows)
    return buffer.scatter_(0, at.reshape(-1), vis.reshape(-1).to(buffer.dtype))


# --------------------------------------------------------------------------------------------
# Walk


def walk_posterior(tree: DraftTree, posterior: Tensor) -> WalkResult:
    """Follow the tree from the root while the target's token at the node is one of its children.

    ``posterior [b, B+1]`` holds the target's decided token at every node (argmax, or one sample
    per node: each node is visited at most once, so drawing all rows up front is the same law).
    """
    b, budget = tree.tokens.shape
    device = tree.tokens.device
    rows = budget + 1
    posterior = posterior.long()
    parents = tree.parents[:, 1:]
    valid = parents >= 0
    # matched[p] = the child of p holding posterior[p] (siblings are distinct: at most one).
    hit = valid & (tree.tokens == posterior.gather(1, parents.clamp(min=0)))
    slot = torch.where(hit, parents, torch.full_like(parents, rows))  # misses -> dump slot
    node_ids = torch.arange(1, rows, device=device).expand(b, budget)
    matched = torch.full((b, rows + 1), -1, dtype=torch.long, device=device)
    matched = matched.scatter_(1, slot, node_ids)[:, :rows]

    steps = tree.horizon + 1
    accepted = torch.full((b, steps), -1, dtype=torch.long, device=device)
    accepted[:, 0] = 0
    cur = torch.zeros((b,), dtype=torch.long, device=device)
    live = torch.ones((b,), dtype=torch.bool, device=device)
    for step in range(1, steps):  # loop over depth, not over requests
        nxt = matched.gather(1, cur.unsqueeze(1)).squeeze(1)
        live = live & (nxt >= 0)
        accepted[:, step] = torch.where(live, nxt, accepted[:, step])
        cur = torch.where(live, nxt, cur)
    num = (accepted >= 0).sum(dim=1)
    bonus = posterior.gather(1, cur.unsqueeze(1)).squeeze(1)
    node_tokens = torch.cat([torch.full((b, 1), -1, dtype=torch.long, device=device), tree.tokens], 1)
    emitted = torch.where(accepted >= 0, node_tokens.gather(1, accepted.clamp(min=0)), -1)
    emitted = torch.cat([emitted[:, 1:], torch.full((b, 1), -1, dtype=torch.long, device=device)], 1)
    emitted.scatter_(1, (num - 1).unsqueeze(1), bonus.unsqueeze(1))
    return WalkResult(
        accepted=accepted,
        num_accepted=num,
        bonus=bonus,
        emitted=emitted,
        num_emitted=num.clone(),
        tree_rows=rows,
    )


def walk_greedy(tree: DraftTree, target_logits: Tensor) -> WalkResult:
    """T = 0: the target's argmax at each node decides; ``target_logits [b, B+1, V]``."""
    kernel = _kernel_for("walk_greedy", target_logits)
    if kernel is not None:
        return kernel(tree, target_logits)
    check_rows(tree, target_logits, "target_logits")
    return walk_posterior(tree, target_logits.argmax(dim=-1))


def walk_sample(
    tree: DraftTree, target_probs: Tensor, *, generator: torch.Generator | None = None
) -> WalkResult:
    """Lossless T > 0 walk: sample the target at the node; accept the child holding that token, else
    the sample is the bonus. ``target_probs [b, B+1, V]`` are the processed target probabilities
    (temperature, top-k/top-p already applied). Never min(1, p/q): tree tokens are top-K picks,
    not draft samples, so every committed token is a genuine target sample.
    """
    kernel = _kernel_for("walk_sample", target_probs)
    if kernel is not None:
        return kernel(tree, target_probs, generator=generator)
    check_rows(tree, target_probs, "target_probs")
    b, rows, vocab = target_probs.shape
    flat = target_probs.reshape(b * rows, vocab).float()
    # torch.multinomial's own one-sample draw, argmax(p / Exp(1)) (the same draws for the same
    # generator), without its host-side validity check, which syncs the device every round.
    race = torch.empty_like(flat).exponential_(1, generator=generator)
    samples = torch.argmax(flat / race, dim=-1).reshape(b, rows)
    return walk_posterior(tree, samples)


# --------------------------------------------------------------------------------------------
# Commit


def commit_plan(
    walk: WalkResult, prefix_lens: Tensor, *, page_size: int = 1, tree_rows: int | None = None
) -> CommitPlan:
    """KV commit plan from the accepted indices; see :class:`CommitPlan` for the exact semantics.

    ``tree_rows`` (B+1) defaults to ``walk.tree_rows``.
    """
    kernel = _kernel_for("commit_plan", walk.accepted)
    if kernel is not None:
        return kernel(walk, prefix_lens, page_size=page_size, tree_rows=tree_rows)
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    rows = tree_rows if tree_rows is not None else walk.tree_rows
    if rows is None:
        raise ValueError("commit_plan needs the tree size: pass tree_rows=B+1 (walk.tree_rows is unset)")
    acc = walk.accepted
    b, width = acc.shape
    device = acc.device
    prefix = torch.as_tensor(prefix_lens, device=device).long().reshape(b, 1)
    valid = acc >= 0
    neg = torch.full_like(acc, -1)
    dst = torch.where(valid, torch.arange(width, device=device).expand(b, width), neg)
    keep = torch.zeros((b, rows + 1), dtype=torch.bool, device=device)
    keep.scatter_(1, torch.where(valid, acc, torch.full_like(acc, rows)), True)
    src_loc = torch.where(valid, prefix + acc, neg)
    dst_loc = torch.where(valid, prefix + dst, neg)
    src_page = torch.where(valid, torch.div(src_loc, page_size, rounding_mode="floor"), neg)
    dst_page = torch.where(valid, torch.div(dst_loc, page_size, rounding_mode="floor"), neg)
    copy = valid & (acc != dst)
    new_len = prefix.squeeze(1) + walk.num_accepted
    return CommitPlan(
        src=acc.clone(),
        dst=dst,
        num_rows=walk.num_accepted.clone(),
        keep=keep[:, :rows],
        copy=copy,
        src_loc=src_loc,
        dst_loc=dst_loc,
        src_page=src_page,
        src_offset=torch.where(valid, src_loc % page_size, neg),
        dst_page=dst_page,
        dst_offset=torch.where(valid, dst_loc % page_size, neg),
        page_moves=_page_moves(src_page, dst_page, copy),
        new_len=new_len,
        free_page_start=_ceil_div(new_len, page_size),
        free_page_end=_ceil_div(prefix.squeeze(1) + rows, page_size),
        page_size=page_size,
    )


def _ceil_div(x: Tensor, d: int) -> Tensor:
    return torch.div(x + d - 1, d, rounding_mode="floor")


def _page_moves(src_page: Tensor, dst_page: Tensor, copy: Tensor) -> Tensor:
    """Distinct (src_page, dst_page) pairs of the cross-page copies, in copy order, -1 padded."""
    b, width = src_page.shape
    cross = copy & (src_page != dst_page)
    pair = torch.stack([src_page, dst_page], dim=-1)
    prev_same = torch.zeros_like(cross)
    prev_same[:, 1:] = (pair[:, 1:] == pair[:, :-1]).all(-1) & cross[:, :-1]
    # Copies run in increasing order and both pages are non-decreasing, so equal pairs are adjacent.
    first = cross & ~prev_same
    slot = torch.cumsum(first.long(), dim=1) - 1
    out = torch.full((b, width + 1, 2), -1, dtype=torch.long, device=src_page.device)
    target = torch.where(first, slot, torch.full_like(slot, width))
    out.scatter_(1, target.unsqueeze(-1).expand(b, width, 2), pair)
    out[:, width] = -1
    return out[:, :width]
