"""What the drafter's head moves between TP ranks per decode round: bytes, by arithmetic.

Rows per round are ``batch x (block - 1)`` (one per draft depth). Stdlib only: the memory planner
(host side, no torch) and the benchmark (scripts/kernels/tp_head_bench.py) read the same figures.
"""

from __future__ import annotations

FP32 = 4


def head_rows(batch: int, block_size: int) -> int:
    """Depth rows the drafter's head ranks per round: L = block - 1 per request."""
    return max(int(batch), 0) * max(int(block_size) - 1, 0)


def exchange_bytes(rows: int, k: int, world: int) -> int:
    """Per rank, each way: the all-gather of ``[rows, 2k + 1]`` fp32 (top-K logits, ids, sum-exp)
    that ``tp_head`` does; a rank sends its buffer to, and receives one from, each other rank."""
    return (world - 1) * rows * (2 * k + 1) * FP32


def allreduce_bytes(rows: int, vocab: int, world: int) -> int:
    """Per rank, each way: the ``[rows, V]`` fp32 MAX all-reduce of the full-vocabulary logits that
    ``tp_head`` replaced (a ring all-reduce moves 2 (world - 1) / world of the tensor)."""
    return 2 * (world - 1) * rows * vocab * FP32 // world


def local_logits_bytes(rows: int, vocab: int, world: int) -> int:
    """fp32 logits one rank holds for the head: its shard ``[rows, ceil(V / world)]``."""
    return rows * -(-vocab // world) * FP32
