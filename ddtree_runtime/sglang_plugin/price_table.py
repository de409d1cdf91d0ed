"""The server's own round prices, measured once at start-up (``--speculative-ddtree-price-table``, off by
default until the GPU suite has run it): for each batch size, the median seconds of the target's verify and
of the rest of a round, over a few repetitions, each timed between two device synchronisations.

Only here does the plugin synchronise: the worker calls :func:`measure_prices` from ``init_cuda_graphs``,
after SGLang's and the round's graphs are captured and before the server says ready, never from a served
round (the overlap contract, tests/sglang/test_tree_round_sync.py). What is timed per batch size comes from
``price_stages`` (the server's own graphs replayed, or its eager forwards); the table type is
``core/round_prices.py``.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterable

from ddtree_runtime.core.round_prices import PriceTable, RoundPrice

logger = logging.getLogger(__name__)

REPEATS = 5  # timed runs per stage and batch size (after one untimed run)

Run = Callable[[], object]
Stages = Callable[[int], tuple[Run, Run]]  # batch size -> (verify, rest of the round)


def median_seconds(run: Run, *, repeats: int, sync: Callable[[], None],
                   clock: Callable[[], float] = time.perf_counter) -> float:  # fmt: skip
    """The median wall time of ``run`` over ``repeats`` runs, each between two ``sync`` calls (the device
    finished before the clock starts and before it stops), after one untimed run (first-use costs)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    run()
    times = []
    for _ in range(repeats):
        sync()
        start = clock()
        run()
        sync()
        times.append(clock() - start)
    return statistics.median(times)


def measure_prices(
    width: str,
    sizes: Iterable[int],
    stages: Stages,
    *,
    method: str,
    sync: Callable[[], None],
    repeats: int = REPEATS,
    clock: Callable[[], float] = time.perf_counter,
) -> PriceTable:
    """The table for one width at every batch size in ``sizes`` (``stages(bs)`` gives the two runs)."""
    started = clock()
    prices: dict[tuple[str, int], RoundPrice] = {}
    for bs in sorted({int(s) for s in sizes}):
        verify, rest = stages(bs)
        prices[(width, bs)] = RoundPrice(
            median_seconds(verify, repeats=repeats, sync=sync, clock=clock),
            median_seconds(rest, repeats=repeats, sync=sync, clock=clock),
        )
    table = PriceTable(prices, method, repeats, clock() - started)
    logger.info("DDTREE: round prices (%s, width %s) at batch sizes %s in %.1f s", method, width,
                sorted(b for _, b in prices), table.measure_s)  # fmt: skip
    return table


def merge_tables(tables: list[PriceTable]) -> PriceTable:
    """One table from each width's (an adaptive server's); its method is ``eager`` where any width's was (a
    narrower width verifies eagerly on a GPU while the widest replays SGLang's graphs)."""
    if not tables:
        raise ValueError("no price table to merge")
    if len(tables) == 1:
        return tables[0]
    methods = {t.method for t in tables}
    method = "eager" if "eager" in methods else tables[0].method
    if len(methods) > 1:
        logger.info("DDTREE: round prices by width: %s", {t.widths()[0]: t.method for t in tables})
    prices = {key: price for t in tables for key, price in t.prices.items()}
    return PriceTable(prices, method, tables[0].repeats, sum(t.measure_s for t in tables))
