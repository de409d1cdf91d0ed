"""Triton kernels for the DDTree round, with the contract of ``ddtree_runtime.core.tree`` (batched).

``tree.build_tree`` / ``compile_tree`` / ``walk_greedy`` / ``commit_plan`` dispatch here for CUDA
tensors when :func:`available` says so. Each function launches a fixed number of kernels with
static output shapes for a given (batch, budget) and never reads device memory from the host, so
a whole round can be captured in a CUDA graph. ``walk_sample`` and ``verify_attention_mask`` are
not offered (the plain path runs them; the mask's shape depends on the prefix lengths anyway).

The kernel modules import Triton; this module does not, so ``available()`` is cheap and safe.
The result types come from ``ddtree_runtime.core.tree_types``; nothing here imports ``tree`` (the
dispatch runs one way, tree -> kernels).
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from ddtree_runtime.core.tree_types import CommitPlan, DraftTopK, DraftTree, VerifyInputs, WalkResult

__all__ = [
    "available",
    "build_tree",
    "build_tree_from_topk",
    "commit_plan",
    "compile_tree",
    "shard_topk",
    "supports_build",
    "walk_greedy",
]


def available() -> bool:
    """True when the CUDA kernels can run here (a CUDA device and Triton)."""
    if importlib.util.find_spec("triton") is None:
        return False
    import torch

    return torch.cuda.is_available()


def supports_build(horizon: int, budget: int, vocab: int, topk_cap: int | None = None) -> bool:
    """Whether the build kernel covers this shape (L <= MAX_HORIZON, K <= MAX_TOPK)."""
    from .build import MAX_HORIZON, MAX_TOPK

    k = min(max(int(budget), 0), vocab, topk_cap or max(int(budget), 0))
    return horizon <= MAX_HORIZON and k <= MAX_TOPK


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _check_device(t: Tensor, what: str) -> None:
    if not t.is_cuda and not _interpreting():
        raise ValueError(
            f"{what} is on {t.device}: the Triton kernels need CUDA tensors "
            "(or TRITON_INTERPRET=1 to run them on the CPU); use ddtree_runtime.core.tree for CPU tensors"
        )


def build_tree(draft_logits: Tensor, budget: int, *, topk_cap: int | None = None) -> DraftTree:
    """Kernel version of ``tree.build_tree``: top-K + logsumexp launch pair, then one build launch."""
    from ddtree_runtime.core import tree_types

    from .build import build_from_topk
    from .topk import topk_log_probs

    tree_types.check_build_inputs(draft_logits, topk_cap)
    _check_device(draft_logits, "draft_logits")
    b, horizon, vocab = draft_logits.shape
    budget = max(int(budget), 0)
    if budget == 0 or horizon == 0 or vocab == 0:
        return tree_types.empty_tree(b, budget, horizon, draft_logits.device)
    k = min(budget, vocab, topk_cap or budget)
    top_lp, top_ids = topk_log_probs(draft_logits, k)
    tokens, depths, parents, scores, num_nodes = build_from_topk(top_lp, top_ids, budget)
    return tree_types.DraftTree(
        tokens=tokens, depths=depths, parents=parents, scores=scores, num_nodes=num_nodes, horizon=horizon
    )


def build_tree_from_topk(top: DraftTopK, budget: int) -> DraftTree:
    """Kernel version of ``tree.build_tree_from_topk`` (K = top.k, already cut): one build launch."""
    from ddtree_runtime.core import tree_types

    from .build import build_from_topk

    _check_device(top.log_probs, "top.log_probs")
    tokens, depths, parents, scores, num_nodes = build_from_topk(top.log_probs, top.ids, budget)
    return tree_types.DraftTree(
        tokens=tokens, depths=depths, parents=parents, scores=scores, num_nodes=num_nodes,
        horizon=int(top.ids.shape[1]),
    )


def shard_topk(logits: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A vocabulary shard's exact top-``k`` by (logit descending, id ascending): (fp32 logits
    ``[..., k]``, int64 LOCAL ids, fp32 row max, fp32 row sum of exp(x - max)), 3-4 launches
    (``topk.topk_launches(raw=True)``)."""
    from .topk import topk_launches

    _check_device(logits, "logits")
    launches, values, ids, lse = topk_launches(logits, k, raw=True)
    for _, launch in launches:
        launch()
    lead = logits.shape[:-1]
    return values, ids, lse[:, 0].reshape(lead), lse[:, 2].reshape(lead)


def compile_tree(draft: DraftTree, root_tokens: Tensor, prefix_lens: Tensor) -> VerifyInputs:
    """Kernel version of ``tree.compile_tree`` (one launch)."""
    import torch

    from ddtree_runtime.core import tree_types

    from .compile import compile_arrays

    _check_device(draft.tokens, "tree.tokens")
    dev = draft.tokens.device
    ids, pos, vis, ridx, next_tok, next_sib = compile_arrays(
        draft.tokens,
        draft.depths,
        draft.parents,
        draft.horizon,
        torch.as_tensor(root_tokens, device=dev),
        torch.as_tensor(prefix_lens, device=dev),
    )
    return tree_types.VerifyInputs(
        input_ids=ids,
        positions=pos,
        visibility=vis,
        retrieve_index=ridx,
        retrieve_next_token=next_tok,
        retrieve_next_sibling=next_sib,
    )


def walk_greedy(draft: DraftTree, target_logits: Tensor) -> WalkResult:
    """Kernel version of ``tree.walk_greedy``: split-V argmax launch, then one walk launch."""
    from ddtree_runtime.core import tree_types

    from .walk import walk_arrays

    tree_types.check_rows(draft, target_logits, "target_logits")
    _check_device(target_logits, "target_logits")
    acc, num, bonus, emit, num_emit = walk_arrays(draft.tokens, draft.parents, draft.horizon, target_logits)
    return tree_types.WalkResult(
        accepted=acc,
        num_accepted=num,
        bonus=bonus,
        emitted=emit,
        num_emitted=num_emit,
        tree_rows=draft.budget + 1,
    )


def commit_plan(
    walk: WalkResult, prefix_lens: Tensor, *, page_size: int = 1, tree_rows: int | None = None
) -> CommitPlan:
    """Kernel version of ``tree.commit_plan`` (one launch)."""
    import torch

    from ddtree_runtime.core import tree_types

    from .walk import commit_arrays

    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    rows = tree_rows if tree_rows is not None else walk.tree_rows
    if rows is None:
        raise ValueError("commit_plan needs the tree size: pass tree_rows=B+1 (walk.tree_rows is unset)")
    _check_device(walk.accepted, "walk.accepted")
    fields = commit_arrays(
        walk.accepted,
        walk.num_accepted,
        torch.as_tensor(prefix_lens, device=walk.accepted.device),
        rows,
        page_size,
    )
    return tree_types.CommitPlan(page_size=page_size, **fields)
