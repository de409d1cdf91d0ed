"""Host-side sizes for a tree round from bounds the scheduler already keeps, never from the device.

SGLang's overlap scheduler runs the worker's forward while it prepares the next batch; a host read
of a device value inside the forward (``.item()``, ``.tolist()``, a boolean selection) would stall
that loop every round. ``DFlashWorkerV2``'s decode sizes its forward batches from the same bounds
(``dflash_worker_v2.py`` ~2588-2640, ~2841-2848 in 0.5.23). Duck-typed on SGLang's batch.
"""

from __future__ import annotations

from typing import Any

import torch


def host_length_bound(batch: Any, extra: int = 0) -> tuple[torch.Tensor, int]:
    """A host-side upper bound of each request's KV length + ``extra`` and its sum, without
    reading the device (as DFlashWorkerV2's decode bounds them): the host lengths when the
    scheduler keeps them (non-overlap, or a backend that needs them), else the reserved lengths
    of ``prepare_for_decode`` (``nxt_kv_lens_cpu``, which covers this round's window), else each
    request's allocated length."""
    if getattr(batch, "seq_lens_cpu", None) is not None:
        lens = batch.seq_lens_cpu + extra
        return lens, int(lens.sum())
    info = batch.spec_info
    if getattr(info, "nxt_kv_lens_cpu", None) is not None:
        return info.nxt_kv_lens_cpu, int(info.nxt_kv_lens_sum)
    lens = torch.tensor([int(req.kv.kv_allocated_len) for req in batch.reqs], dtype=torch.int64)
    return lens, int(lens.sum())


def verify_mask_cells(batch: Any, cfg: Any, runner: Any) -> int:
    """Host bound of the flat tree mask (sum over requests of (B+1) * (prefix + B+1)), capped at
    the target backend's verify-mask buffer, which holds any real batch (the graph path copies
    the mask into it)."""
    rows = int(cfg.verify_rows)
    _lens, total = host_length_bound(batch)
    cells = rows * (total + rows * len(batch.reqs))
    backend = getattr(runner, "attn_backend", None)
    for candidate in (backend, getattr(backend, "full_attn_backend", None)):
        buffer = getattr(getattr(candidate, "verify_mask", None), "buffer", None)
        if isinstance(buffer, torch.Tensor):
            return min(cells, int(buffer.numel()))
    return cells
