"""A device tensor's values to the host without a host sync on the decode path: an asynchronous copy into
pinned memory and the event a later round queries (counterfactual scoring's counters, an adaptive server's
per-width tokens). On the host (CPU) the copy is complete when issued."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class Done:
    """The event of a copy that completed when it was issued (a tensor on the host)."""

    def query(self) -> bool:
        return True


def copy_to_host(vec: Tensor, host: Tensor) -> Any:
    """Issue ``host.copy_(vec)`` (non-blocking from CUDA) and return the event to query before reading
    ``host``."""
    cuda = vec.device.type == "cuda"
    host.copy_(vec, non_blocking=cuda)
    if not cuda:
        return Done()
    event = torch.cuda.Event()
    event.record()
    return event
