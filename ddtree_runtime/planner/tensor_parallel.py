"""What a TP group costs and saves per GPU against one GPU, beside the memory terms of a plan.

Saves: each rank holds 1/tp of the matrices (vectors are replicated) and of the KV heads, and
holds the drafter head's fp32 logits for its vocabulary shard only. Costs: NCCL's share of the
CUDA context (an estimate), and every decode round the drafter head's exchange: since issue 25
each rank all-gathers its rows' top-K + sum-exp, ``[rows, 2K + 1]`` fp32 (``tp_head``), where a
``[rows, V]`` fp32 all-reduce went before; rows = running requests x (block - 1). The target's own
per-layer all-reduces are SGLang's and not counted here. Bytes are per rank, each way, per round.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ddtree_runtime.core.tp_head_cost import allreduce_bytes, exchange_bytes, head_rows, local_logits_bytes
from ddtree_runtime.planner.shapes import DTYPE_BYTES

if TYPE_CHECKING:
    from ddtree_runtime.planner.accounting import Plan

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class TensorParallel:
    tp: int
    weights_gib: float  # target + drafter, per GPU at this tp
    weights_gib_tp1: float
    kv_kib_per_token: float  # target + drafter, per GPU
    kv_kib_per_token_tp1: float
    context_gib_extra: float  # NCCL's share of the CUDA context (estimate)
    running_requests: int
    head_rows: int  # drafter head rows per round: running requests x (block - 1)
    topk: int  # 0 for the chain case (DFLASH's own greedy head, not the tree's)
    exchange_bytes: int  # the top-K all-gather, per rank each way per round
    full_vocab_allreduce_bytes: int  # what it replaced
    head_logits_mib: float  # the head's fp32 logits per GPU
    head_logits_mib_tp1: float

    def to_dict(self) -> dict[str, Any]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}

    def lines(self) -> list[str]:
        head = (
            f"the drafter head exchanges {self.exchange_bytes / 1e3:,.1f} KB per decode round per rank "
            f"each way (top-{self.topk} + logsumexp of {self.head_rows} rows; the [rows, V] fp32 "
            f"all-reduce it replaced: {self.full_vocab_allreduce_bytes / 1e6:,.1f} MB)"
            if self.topk
            else "the chain case runs DFLASH's own greedy head (a max and an id per row)"
        )
        return [
            f"  tensor parallel (tp-size {self.tp}), per GPU against one GPU, at {self.running_requests} "
            "running requests:",
            f"    saves: weights {self.weights_gib:.1f} of {self.weights_gib_tp1:.1f} GiB; KV "
            f"{self.kv_kib_per_token:.1f} of {self.kv_kib_per_token_tp1:.1f} KiB per token; drafter head "
            f"logits {self.head_logits_mib:.1f} of {self.head_logits_mib_tp1:.1f} MiB",
            f"    costs: NCCL +{self.context_gib_extra:.1f} GiB of CUDA context (estimate); {head}",
        ]


def tensor_parallel(plan: Plan) -> TensorParallel | None:
    """The trade-off of ``plan``'s TP size; None at TP 1 or before settings resolve."""
    from ddtree_runtime.planner.accounting import CONTEXT_GIB, CONTEXT_GIB_TP

    r, tp = plan.resolved, plan.settings.tp_size
    if r is None or tp <= 1:
        return None
    target, draft = plan.pair.target, plan.pair.draft
    kv = DTYPE_BYTES[r.kv_dtype]
    running = plan.running_requests or r.requested_running
    rows = head_rows(running, r.block_size)
    vocab = target.vocab_size
    # K as tree_types.topk_width: min(budget, V, top-k cap)
    k = 0 if r.decoder.is_chain or not vocab else min(r.budget, vocab, r.decoder.topk_cap or r.budget)
    return TensorParallel(
        tp=tp,
        weights_gib=(target.weights.per_rank(tp) + draft.weights.per_rank(tp)) / GIB,
        weights_gib_tp1=(target.weights.per_rank(1) + draft.weights.per_rank(1)) / GIB,
        kv_kib_per_token=(target.kv_bytes_per_token(tp, kv) + draft.kv_bytes_per_token(tp, kv)) / 1024,
        kv_kib_per_token_tp1=(target.kv_bytes_per_token(1, kv) + draft.kv_bytes_per_token(1, kv)) / 1024,
        context_gib_extra=CONTEXT_GIB_TP - CONTEXT_GIB[1],
        running_requests=running,
        head_rows=rows,
        topk=k,
        exchange_bytes=exchange_bytes(rows, k, tp) if k else 0,
        full_vocab_allreduce_bytes=allreduce_bytes(rows, vocab, tp) if k else 0,
        head_logits_mib=local_logits_bytes(rows, vocab, tp) / MIB,
        head_logits_mib_tp1=local_logits_bytes(rows, vocab, 1) / MIB,
    )
