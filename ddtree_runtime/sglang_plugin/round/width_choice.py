"""An adaptive server's width per round (``--speculative-ddtree-budget auto`` or a list, issue 41): the
host-side ``core/width_policy.WidthChooser`` over the server's own start-up prices, fed by the tokens each
width's rounds emitted.

Nothing here reads the device in a round. A round's emitted tokens are added on the device into a
per-width counter (one ``index_add_`` in stream order after the round); at most every ``interval_s`` the
counter is copied asynchronously into pinned host memory, and a later round that finds the copy's event
complete hands the values to the chooser, with the request-rounds the host had dispatched when the copy
was issued (every add enqueued before the copy is in it). The batch size a round chooses by is the host's
(``len(batch.reqs)``).

Rounds of the plugin's start-up warm-up (``warmup.py``, random prompts) take the width their requests' ids
name (the warm-up runs every width at every size) so each one's kernels compile before the server says
ready, and are not counted: their acceptance is not traffic's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ddtree_runtime.core.round_prices import PriceTable
from ddtree_runtime.core.width_policy import WidthChooser
from ddtree_runtime.sglang_plugin.round.readback import copy_to_host

logger = logging.getLogger(__name__)

READBACK_INTERVAL_S = 0.5


def _width_named(rest: str) -> int | None:
    head = rest.split("-", 1)[0]
    return int(head) if head.isdigit() else None


class WidthChoice:
    """The worker's adaptive state: the chooser, the device counter and its readback, the metrics sink."""

    def __init__(
        self,
        budgets: Sequence[int],
        prices: PriceTable,
        device: torch.device,
        *,
        warmup_prefix: str,
        interval_s: float = READBACK_INTERVAL_S,
        clock: Callable[[], float] | None = None,
        publish: Callable[[WidthChooser], None] | None = None,
        **chooser_args: Any,
    ) -> None:
        self.budgets = tuple(int(b) for b in budgets)
        labels = tuple(str(b) for b in self.budgets)
        seconds = {(w, bs): p.round_s for (w, bs), p in prices.prices.items() if w in labels}
        self.chooser = WidthChooser(labels, seconds, **chooser_args)
        self.device = device
        self.warmup_prefix = warmup_prefix
        self.interval_s = interval_s
        self.clock = clock or time.monotonic
        self.publish = publish
        self.tokens = torch.zeros(len(self.budgets), dtype=torch.int64, device=device)
        self._slot: dict[int, Tensor] = {}  # width index -> [max bs] of that index (index_add_'s index)
        self._host = torch.zeros(len(self.budgets), dtype=torch.int64, pin_memory=device.type == "cuda")
        self._copy: tuple[Any, dict[str, int]] | None = None  # (event, rows dispatched at the copy)
        self._next = 0.0
        self._warm_turn = 0

    def pick(self, reqs: Sequence[Any]) -> tuple[int, bool]:
        """(budget, counted) for a round over ``reqs``: the chooser's width at ``len(reqs)``; a warm-up round
        takes the width its requests' ids name (the warm-up runs every width at every size), else the
        widths in turn; uncounted."""
        rid = str(getattr(reqs[0], "rid", "")) if reqs else ""
        if rid.startswith(self.warmup_prefix):
            named = _width_named(rid[len(self.warmup_prefix) :])
            if named in self.budgets:
                return named, False
            self._warm_turn += 1
            return self.budgets[self._warm_turn % len(self.budgets)], False
        return int(self.chooser.choose(len(reqs))), True

    def count(self, budget: int, commit_lens: Tensor) -> None:
        """After a counted round: its emitted tokens into the width's counter (device, stream-ordered), then
        the readback step."""
        index = self.budgets.index(budget)
        bs = int(commit_lens.shape[0])
        slot = self._slot.get(index)
        if slot is None or slot.shape[0] < bs:
            slot = torch.full((max(bs, 64),), index, dtype=torch.long, device=self.device)
            self._slot[index] = slot
        self.tokens.index_add_(0, slot[:bs], commit_lens.reshape(-1).to(torch.int64))
        self._readback()

    def _readback(self) -> None:
        if self._copy is not None and self._copy[0].query():
            _, rows = self._copy
            self._copy = None
            values = self._host.tolist()  # host memory, the copy complete: no device read
            self.chooser.observe({str(b): float(v) for b, v in zip(self.budgets, values, strict=True)}, rows)
            if self.publish is not None:
                self.publish(self.chooser)
        now = self.clock()
        if self._copy is not None or now < self._next:
            return
        self._next = now + self.interval_s
        self._copy = (copy_to_host(self.tokens, self._host), dict(self.chooser.dispatched_rows))

    def to_dict(self) -> dict[str, Any]:
        return self.chooser.to_dict()
