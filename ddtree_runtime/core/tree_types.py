"""The DDTree round's data: the result types every implementation returns and the argument checks
they share.

``ddtree_runtime.core.tree`` (plain PyTorch) and ``ddtree_runtime.core.kernels`` (Triton) both import this
module and nothing of each other's internals, so the dispatch runs one way: tree -> kernels.
This module imports nothing else of ours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "CommitPlan",
    "DraftTopK",
    "DraftTree",
    "VerifyInputs",
    "WalkResult",
    "check_build_inputs",
    "check_rows",
    "check_topk_inputs",
    "empty_tree",
    "topk_width",
]

# --------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class DraftTopK:
    """What the tree build reads of the drafter's per-depth distribution: each row's top-K
    log-probabilities over the FULL vocabulary, in the order (logit descending, id ascending),
    and the row's logsumexp. Made from full logits (``tree.topk_log_probs``) or merged over a
    vocabulary-parallel head (``ddtree_runtime.core.tp_head``) without the ``[rows, V]`` logits.
    """

    log_probs: Tensor  # [..., K] float32
    ids: Tensor  # [..., K] int64, global vocabulary ids
    logsumexp: Tensor  # [...] float32, over the whole vocabulary

    @property
    def k(self) -> int:
        return int(self.ids.shape[-1])

    def reshape(self, *lead: int) -> DraftTopK:
        """The same rows under another leading shape (``[b * L]`` -> ``[b, L]``)."""
        return DraftTopK(
            log_probs=self.log_probs.reshape(*lead, self.k),
            ids=self.ids.reshape(*lead, self.k),
            logsumexp=self.logsumexp.reshape(*lead),
        )


@dataclass(frozen=True)
class DraftTree:
    """One draft tree per request; all tensors on the logits' device.

    ``tokens[:, i]`` is node ``i + 1``'s token (the root is not stored). Padded nodes (only when
    fewer than B prefixes exist, e.g. ``topk_cap=1`` with ``B > L``) have token -1, depth 0,
    parent -1 and score -inf; they are never anyone's parent and never accepted.
    """

    tokens: Tensor  # [b, B] int64
    depths: Tensor  # [b, B] int64, 1-based
    parents: Tensor  # [b, B+1] int64, parents[:, 0] = -1, parents[:, i] < i
    scores: Tensor  # [b, B] float32, sum of log-probs along the root path, non-increasing
    num_nodes: Tensor  # [b] int64
    horizon: int  # L

    @property
    def budget(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class VerifyInputs:
    """What the target's verify forward consumes (B+1 rows per request, root first)."""

    input_ids: Tensor  # [b, B+1] root = previous bonus token, then node tokens (padding -> 0)
    positions: Tensor  # [b, B+1] prefix_len + depth (root depth 0; siblings share a position)
    visibility: Tensor  # [b, B+1, B+1] bool, row i sees its ancestors and itself
    retrieve_index: Tensor  # [b, B+1] flat row index b*(B+1)+i
    retrieve_next_token: Tensor  # [b, B+1] first child (local index, pop order) or -1
    retrieve_next_sibling: Tensor  # [b, B+1] next sibling (local index, pop order) or -1


@dataclass(frozen=True)
class WalkResult:
    """The accepted root path of each request after verification.

    ``tree_rows`` (B+1) is carried so that :func:`commit_plan` knows how many KV rows the verify
    pass wrote; it is ``None`` only for results built by hand.
    """

    accepted: Tensor  # [b, L+1] int64 node indices, accepted[:, 0] = 0, -1 padded
    num_accepted: Tensor  # [b] int64 = len(acc) incl. root (the acceptance length tau)
    bonus: Tensor  # [b] int64, target token after the last accepted node
    emitted: Tensor  # [b, L+1] int64 tokens(acc[1:]) + bonus, -1 padded
    num_emitted: Tensor  # [b] == num_accepted
    tree_rows: int | None = None  # B+1


@dataclass(frozen=True)
class CommitPlan:
    """Which KV rows survive a round and where they go.

    Rows are counted relative to the request's prefix: the verify pass wrote node ``i``'s K/V at
    logical position ``prefix_len + i`` (i = 0..B). The accepted nodes ``acc`` (strictly
    increasing, ``acc[0] = 0``) must end up at logical positions ``prefix_len + 0 ..
    prefix_len + a - 1`` in order, ``a = num_rows``. Hence ``dst[k] = k <= src[k] = acc[k]``:
    copying the rows in increasing ``k`` in place never overwrites a row still to be read.

    Two ways to apply it, both exact:

    * page_size 1 (SGLang's req_to_token remap, no data copy): set
      ``req_to_token[prefix + dst[k]] = slot_of(prefix + src[k])`` for the valid ``k`` and free the
      slots of the rows with ``keep == False``.
    * any page size (move rows): for each valid ``k`` with ``copy[k]``, copy the K/V at logical
      position ``src_loc[k]`` (page ``src_page[k]``, offset ``src_offset[k]`` of the request's page
      table) to ``dst_loc[k]`` (``dst_page[k]``, ``dst_offset[k]``), in increasing ``k``. Then the
      request's length is ``new_len``; the pages with logical page index in
      ``[free_page_start, free_page_end)`` held only tree rows past ``new_len`` and are freed;
      page ``free_page_start - 1`` (if it is >= the page of ``prefix_len``) stays, partly filled.
      ``page_moves`` lists, per request, the distinct (src_page -> dst_page) pairs touched by the
      copies (-1 padded), for kernels that move whole-page spans.
    """

    src: Tensor  # [b, L+1] node index (= row relative to prefix) of each accepted node, -1 padded
    dst: Tensor  # [b, L+1] destination row relative to prefix, dst <= src, -1 padded
    num_rows: Tensor  # [b] = num_accepted
    keep: Tensor  # [b, B+1] bool, row i holds an accepted node
    copy: Tensor  # [b, L+1] bool, a real move (src != dst)
    src_loc: Tensor  # [b, L+1] absolute logical position prefix + src, -1 padded
    dst_loc: Tensor  # [b, L+1] absolute logical position prefix + dst, -1 padded
    src_page: Tensor  # [b, L+1] src_loc // page_size, -1 padded
    src_offset: Tensor  # [b, L+1] src_loc % page_size, -1 padded
    dst_page: Tensor  # [b, L+1]
    dst_offset: Tensor  # [b, L+1]
    page_moves: Tensor  # [b, L+1, 2] distinct (src_page, dst_page) with src_page != dst_page, -1 padded
    new_len: Tensor  # [b] prefix_len + num_rows
    free_page_start: Tensor  # [b] ceil(new_len / page_size)
    free_page_end: Tensor  # [b] ceil((prefix_len + B + 1) / page_size)
    page_size: int


def check_build_inputs(draft_logits: Tensor, topk_cap: int | None) -> None:
    """The argument checks every ``build_tree`` (plain or kernel) makes before any work."""
    if draft_logits.dim() != 3:
        raise ValueError(f"draft_logits must be [batch, L, V], got shape {tuple(draft_logits.shape)}")
    if not draft_logits.is_floating_point():
        raise ValueError(f"draft_logits must be a float tensor, got {draft_logits.dtype}")
    if topk_cap is not None and topk_cap < 1:
        raise ValueError(f"topk_cap must be >= 1 or None, got {topk_cap}")


def topk_width(budget: int, vocab: int, topk_cap: int | None = None) -> int:
    """K, the candidates per depth the tree can use: min(budget, V, top-k cap)."""
    budget = max(int(budget), 0)
    return min(budget, int(vocab), topk_cap or budget)


def check_topk_inputs(top: DraftTopK, topk_cap: int | None) -> None:
    """The argument checks every ``build_tree_from_topk`` makes before any work."""
    if top.log_probs.dim() != 3 or top.ids.shape != top.log_probs.shape:
        raise ValueError(
            "draft top-K must be log_probs and ids of one shape [batch, L, K], got "
            f"{tuple(top.log_probs.shape)} and {tuple(top.ids.shape)}"
        )
    if top.log_probs.dtype != torch.float32 or top.ids.dtype != torch.int64:
        raise ValueError(
            "draft top-K must be float32 log-probs and int64 ids, "
            f"got {top.log_probs.dtype} / {top.ids.dtype}"
        )
    if topk_cap is not None and topk_cap < 1:
        raise ValueError(f"topk_cap must be >= 1 or None, got {topk_cap}")


def empty_tree(b: int, budget: int, horizon: int, device: torch.device) -> DraftTree:
    """A tree of ``budget`` padded nodes per request (budget, horizon or vocabulary zero)."""
    return DraftTree(
        tokens=torch.full((b, budget), -1, dtype=torch.long, device=device),
        depths=torch.zeros((b, budget), dtype=torch.long, device=device),
        parents=torch.full((b, budget + 1), -1, dtype=torch.long, device=device),
        scores=torch.full((b, budget), float("-inf"), dtype=torch.float32, device=device),
        num_nodes=torch.zeros((b,), dtype=torch.long, device=device),
        horizon=horizon,
    )


def check_rows(tree: DraftTree, target: Tensor, what: str) -> None:
    """``target`` must hold one row per tree node (root included) for every request."""
    want = (tree.batch_size, tree.budget + 1)
    if target.dim() != 3 or tuple(target.shape[:2]) != want:
        raise ValueError(
            f"{what} must be [{want[0]}, {want[1]}, V] (one row per tree node incl. root), "
            f"got {tuple(target.shape)}"
        )
