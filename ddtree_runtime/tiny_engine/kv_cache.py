"""What the tiny engine keeps per running request between rounds: the attention layers' K/V rows
(``KVCache``) and, for hybrid targets, the Gated DeltaNet layers' committed conv window and recurrent state
(``RecurrentCache``, kept alongside). Rows follow the batch: requests leave (``select``) and join
(``extend``) between rounds."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class RecurrentCache:
    """Per request and GDN layer: the committed conv window [C, W-1] and delta-rule state
    [HV, K, V]. A forward stages every row's post-token state; ``commit(rows)`` keeps, per request,
    the state after ``rows[r]`` (the accepted node, or the last prompt token)."""

    def __init__(self, shapes: list[tuple[tuple[int, ...], tuple[int, ...]]], batch: int, like: Tensor):
        self.conv = [like.new_zeros((batch, *c)) for c, _ in shapes]
        self.ssm = [torch.zeros((batch, *s), dtype=torch.float32, device=like.device) for _, s in shapes]
        self.staged: list[tuple[Tensor, Tensor] | None] = [None] * len(shapes)

    def stage(self, i: int, windows: Tensor, states: Tensor) -> None:
        self.staged[i] = (windows, states)

    def commit(self, rows: Tensor) -> None:
        """rows [b]: the row (of the last forward) whose state each request keeps."""
        idx = torch.arange(rows.shape[0], device=rows.device)
        for i, staged in enumerate(self.staged):
            if staged is None:
                raise RuntimeError("RecurrentCache.commit without a staged forward")
            windows, states = staged
            self.conv[i] = windows[idx, rows].to(self.conv[i].dtype)
            self.ssm[i] = states[idx, rows]
        self.staged = [None] * len(self.staged)

    def select(self, keep: Tensor) -> None:
        self.conv = [t.index_select(0, keep) for t in self.conv]
        self.ssm = [t.index_select(0, keep) for t in self.ssm]

    def extend(self, other: RecurrentCache) -> None:
        self.conv = [torch.cat([a, b]) for a, b in zip(self.conv, other.conv, strict=True)]
        self.ssm = [torch.cat([a, b]) for a, b in zip(self.ssm, other.ssm, strict=True)]


class KVCache:
    """Per-layer K/V rows [b, kv_heads, capacity, head_dim]; row i holds the token at logical position i."""

    def __init__(
        self,
        layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        like: Tensor,
        recurrent: RecurrentCache | None = None,
    ):
        shape = (batch, kv_heads, capacity, head_dim)
        self.k = [like.new_zeros(shape) for _ in range(layers)]
        self.v = [like.new_zeros(shape) for _ in range(layers)]
        self.capacity = capacity
        self.recurrent = recurrent  # hybrid targets: the GDN layers' state, kept alongside the KV

    def commit_recurrent(self, rows: Tensor) -> None:
        """Hybrid targets: keep each request's state after ``rows[r]`` of the last forward."""
        if self.recurrent is not None:
            self.recurrent.commit(rows)

    def write(self, layer: int, rows: Tensor, k: Tensor, v: Tensor) -> None:
        """rows [b, n] absolute cache rows for k/v [b, h, n, d]."""
        if int(rows.max()) >= self.capacity:
            raise RuntimeError(f"KV cache overflow: row {int(rows.max())} >= capacity {self.capacity}")
        idx = rows[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        self.k[layer].scatter_(2, idx, k)
        self.v[layer].scatter_(2, idx, v)

    def view(self, layer: int, length: int) -> tuple[Tensor, Tensor]:
        return self.k[layer][:, :, :length], self.v[layer][:, :, :length]

    def move_rows(self, src: Tensor, dst: Tensor) -> None:
        """Copy rows src -> dst per request ([b, m] absolute rows, gathered first so overlaps are safe)."""
        for store in (self.k, self.v):
            for t in store:
                idx_src = src[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
                idx_dst = dst[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
                t.scatter_(2, idx_dst, t.gather(2, idx_src))

    def select(self, keep: Tensor) -> None:
        """Keep only the requests at indices `keep` (finished ones leave the batch)."""
        self.k = [t.index_select(0, keep) for t in self.k]
        self.v = [t.index_select(0, keep) for t in self.v]
        if self.recurrent is not None:
            self.recurrent.select(keep)

    def extend(self, other: KVCache, capacity: int) -> None:
        """Append other's requests as new rows; both grow to `capacity` rows per request."""

        def grow(t: Tensor) -> Tensor:
            return F.pad(t, (0, 0, 0, capacity - t.shape[2]))

        self.k = [torch.cat([grow(a), grow(b)]) for a, b in zip(self.k, other.k, strict=True)]
        self.v = [torch.cat([grow(a), grow(b)]) for a, b in zip(self.v, other.v, strict=True)]
        self.capacity = capacity
        if self.recurrent is not None and other.recurrent is not None:
            self.recurrent.extend(other.recurrent)

