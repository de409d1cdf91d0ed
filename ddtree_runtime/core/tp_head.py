"""The drafter's head under tensor parallelism: every rank ranks its own vocabulary shard, and the
ranks exchange each row's top-K and logsumexp, never the ``[rows, V]`` logits.

Per rank (:func:`shard_topk`): the fp32 logits of its shard ``[N, V_r]``; their top-K by (logit
descending, id ascending) under GLOBAL ids; the shard's max (the first of them) and its sum of
``exp(x - max)``. One all-gather of the packed ``[N, 2K + 1]`` fp32 buffer (:func:`pack`: K
logits, K ids, the sum; ids are exact in fp32 up to 2^24). The same merge on every rank
(:func:`merge`): the top-K of the world x K candidates by (logit descending, id ascending), the
row's max and sum from the shards', and each kept candidate's log-prob by the formula the
single-rank path uses, ``(x - max) - log(sum)``: a :class:`DraftTopK` the tree build reads directly.

Why it is the single-rank result: an element of the full vocabulary's top-K is in its own shard's
top-K (the shards are disjoint and ranked in the same order, by logit), so the merge sees it; the
ids and their order depend on the logits alone, so they are the single-rank path's exactly. Every
rank merges the same bytes with the same operations, so every rank builds the same tree. One fp32
effect remains: the row's sum is added up in another order, so a log-prob may move by an ulp (a
tree can show it only where two paths' scores tie to the ulp). Ranking by the rounded log-prob,
as before 2026-12-02, let that ulp reorder ids: two logits an ulp apart round to one log-prob on
one path and not on the other (found on the H200 at K = 1023, V = 248320; on the CPU at that
shape 7 of 120 rows of random logits).

Nothing of SGLang here: the collective is a callable with the signature of
``torch.distributed.all_gather_into_tensor(out, inp)`` (SGLang's ``GroupCoordinator`` has the
same method), and the shard is three integers (``sglang_plugin/round/draft_head.py`` reads them from
``VocabParallelEmbedding.shard_indices``). On CUDA the shard's top-K runs in the project's Triton
kernel (``kernels.shard_topk``) and the rest is graph-capturable torch (no host reads).
Facts: shared docs tp-drafter-head.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ddtree_runtime.core.tree import stable_topk
from ddtree_runtime.core.tree_types import DraftTopK

__all__ = [
    "MAX_VOCAB",
    "VocabShard",
    "exchange",
    "merge",
    "pack",
    "shard_topk",
    "sharded_topk",
    "vocab_shards",
]

# Ids travel as fp32 in the packed buffer: exact for every integer up to 2^24 (padding takes id V).
MAX_VOCAB = 1 << 24

AllGather = Callable[[Tensor, Tensor], object]  # (out [world * N, C], inp [N, C]), rank-major


@dataclass(frozen=True)
class VocabShard:
    """One rank's slice of the vocabulary: its weight rows ``[0, num)`` hold the global ids
    ``[start, start + num)`` (SGLang's ``org_vocab_start_index`` / ``num_org_elements``); padding
    rows and added-vocabulary rows follow them and are not ranked."""

    start: int
    num: int
    vocab: int

    def __post_init__(self) -> None:
        if self.vocab < 1 or self.start < 0 or self.num < 0 or self.start + self.num > self.vocab:
            raise ValueError(
                f"a vocabulary shard must lie inside the vocabulary: ids [{self.start}, "
                f"{self.start + self.num}) of V = {self.vocab}; check the LM head's shard_indices "
                "against the target config's vocab_size"
            )
        if self.vocab > MAX_VOCAB:
            raise ValueError(
                f"vocabulary {self.vocab} is larger than {MAX_VOCAB}: the sharded drafter head sends ids "
                "as fp32, exact only up to 2^24; serve this model with DDTREE at --tp-size 1, or with "
                "--speculative-algorithm DFLASH"
            )

    @property
    def whole(self) -> bool:
        """The shard is the whole vocabulary (TP 1, or a replicated head): nothing to exchange."""
        return self.start == 0 and self.num == self.vocab


def vocab_shards(vocab: int, world: int, padding: int = 64) -> list[VocabShard]:
    """Every rank's real ids as SGLang's ``VocabParallelEmbedding._get_indices`` lays them out
    (no added vocabulary): the vocabulary padded to a multiple of ``padding`` (times the TP size
    when that does not divide it), cut in equal slices, each slice's real ids first. For the
    benchmark and tests; the plugin reads a live head's own ``shard_indices``."""
    if -(-vocab // padding) * padding % world:
        padding *= world
    per = -(-vocab // padding) * padding // world
    return [VocabShard(min(r * per, vocab), min(per, max(vocab - r * per, 0)), vocab) for r in range(world)]


def _use_kernels(t: Tensor) -> bool:
    """CUDA tensors take the Triton kernel, as ``tree``'s dispatch decides (``DDTREE_DISABLE_KERNELS``)."""
    if not t.is_cuda or os.environ.get("DDTREE_DISABLE_KERNELS") == "1":
        return False
    from ddtree_runtime.core import kernels

    return kernels.available()


def _plain_shard_topk(local: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    values, ids = stable_topk(local, k)
    top = values[:, 0]
    safe = torch.where(torch.isneginf(top), torch.zeros_like(top), top)  # an all -inf row sums to 0
    return values, ids, top, torch.exp(local - safe[:, None]).sum(dim=-1)


def shard_topk(
    local_logits: Tensor, shard: VocabShard, k: int, *, kernel: bool | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's candidates: (fp32 logits ``[N, k]``, int64 GLOBAL ids ``[N, k]``, fp32
    ``sum(exp(x - max))`` ``[N]``), by (logit descending, id ascending); the max is the first logit.

    ``local_logits [N, shard.num]`` are the shard's real rows only. A shard with fewer than ``k``
    ids pads with -inf under id V, after every real id, so a real -inf logit wins the tie.
    """
    if local_logits.dim() != 2 or local_logits.shape[1] != shard.num:
        raise ValueError(
            f"local logits must be [rows, {shard.num}] (the shard's real vocabulary rows), "
            f"got {tuple(local_logits.shape)}"
        )
    if not 1 <= k <= shard.vocab:
        raise ValueError(f"k must be in [1, V={shard.vocab}], got {k}")
    x = local_logits.float()
    n = x.shape[0]
    values = torch.full((n, k), float("-inf"), dtype=torch.float32, device=x.device)
    ids = torch.full((n, k), shard.vocab, dtype=torch.int64, device=x.device)
    sums = torch.zeros((n,), dtype=torch.float32, device=x.device)
    have = min(k, shard.num)
    if have and n:
        if _use_kernels(x) if kernel is None else kernel:
            from ddtree_runtime.core import kernels

            top, local_ids, _, total = kernels.shard_topk(x, have)
        else:
            top, local_ids, _, total = _plain_shard_topk(x, have)
        values[:, :have] = top
        ids[:, :have] = local_ids + shard.start
        sums.copy_(total)
    return values, ids, sums


def pack(values: Tensor, ids: Tensor, sums: Tensor) -> Tensor:
    """``[N, 2K + 1]`` fp32: the K logits, the K ids, the sum: one buffer, one collective."""
    return torch.cat([values, ids.to(torch.float32), sums.unsqueeze(1)], dim=1)


def exchange(packed: Tensor, world: int, all_gather: AllGather) -> Tensor:
    """Every rank's packed buffer, rank-major ``[world * N, 2K + 1]``."""
    out = packed.new_empty((world * packed.shape[0], packed.shape[1]))
    all_gather(out, packed.contiguous())
    return out


def _order_key(values: Tensor, ids: Tensor) -> Tensor:
    """int64 keys whose descending order is (value descending, id ascending): the float's
    order-preserving bits (-0.0 folded onto +0.0) above the inverted id (as kernels/topk.py)."""
    bits = (values + 0.0).view(torch.int32).to(torch.int64)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return ordered * (1 << 32) + (0xFFFFFFFF - ids)


def merge(gathered: Tensor, world: int, k: int) -> DraftTopK:
    """The full vocabulary's top-``k`` log-probs and logsumexp per row, from every rank's packed
    candidates (``[world * N, 2K + 1]``, rank-major). Identical on every rank."""
    width = (gathered.shape[1] - 1) // 2
    if gathered.dim() != 2 or gathered.shape[1] != 2 * width + 1 or gathered.shape[0] % world:
        raise ValueError(f"gathered candidates must be [world * N, 2K + 1], got {tuple(gathered.shape)}")
    if not 1 <= k <= world * width:
        raise ValueError(f"k must be in [1, world x K = {world * width}], got {k}")
    g = gathered.view(world, -1, 2 * width + 1)
    values, ids, sums = g[..., :width], g[..., width : 2 * width].to(torch.int64), g[..., 2 * width]
    shard_max = values[..., 0]  # [world, N]
    top = shard_max.amax(dim=0)  # the row's max: what log_softmax subtracts
    safe = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    total = (sums * torch.exp(shard_max - safe)).sum(dim=0)  # the shards' sums, rescaled to `top`
    log_sum = torch.log(total)
    n = top.shape[0]
    values = values.permute(1, 0, 2).reshape(n, world * width)
    ids = ids.permute(1, 0, 2).reshape(n, world * width)
    # By the logit, not the rounded log-prob (see the module doc); the keys are unique (ids are).
    best = torch.topk(_order_key(values, ids), k, dim=-1, sorted=True).indices
    log_probs = (values.gather(1, best) - top[:, None]) - log_sum[:, None]  # (x - max) - log(sum)
    return DraftTopK(log_probs=log_probs, ids=ids.gather(1, best), logsumexp=top + log_sum)


def sharded_topk(
    local_logits: Tensor,
    shard: VocabShard,
    k: int,
    *,
    world: int,
    all_gather: AllGather,
    kernel: bool | None = None,
) -> DraftTopK:
    """The full vocabulary's per-row top-``k`` and logsumexp from this rank's shard logits: shard
    top-K, one all-gather of ``[N, 2k + 1]`` fp32 over the ``world`` ranks, the merge."""
    values, ids, sums = shard_topk(local_logits, shard, k, kernel=kernel)
    return merge(exchange(pack(values, ids, sums), world, all_gather), world, k)
