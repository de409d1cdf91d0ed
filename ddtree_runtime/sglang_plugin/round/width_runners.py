"""Each narrower width of an adaptive server with its own attention backend and target verify graphs
(``SGLANG_DDTREE_WIDTH_GRAPHS=1``; off by default until the GPU suite has run it), so its rounds replay graphs
as the widest width's do instead of running eagerly.

SGLang captures the target's verify for one width: ``speculative_num_draft_tokens`` sizes the attention
backend (its verify-mask buffer, its per-token buffers) and the graph runner's static inputs. Adaptive EAGLE
(``speculative/eagle_worker_v2.py``, ``build_adaptive_runtime_state``) and UNO's tree mode
(``speculative/uno_worker_v2.py``) run a second width the same way this module does: a backend built under a
scoped ``get_spec().override(speculative_num_draft_tokens=W)``, a ``DecodeCudaGraphRunner`` captured with that
backend at that width, and the two swapped onto the target's model runner around a round of that width
(``../shared/docs/tree-round-graphs.md``, section 3). The KV reservation stays the widest width's. The
plugin's hook answers the narrower width's verify rows while it is captured (``algorithm.verify_width``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

ENV_SWITCH = "SGLANG_DDTREE_WIDTH_GRAPHS"


def wanted() -> bool:
    return os.environ.get(ENV_SWITCH, "0") == "1"


@dataclass
class WidthRunner:
    """One narrower width's target-side runtime: its backend, and its graphs where SGLang captures any."""

    rows: int
    attn_backend: Any
    graph_runner: Any = None


def _captures(runner: Any) -> bool:
    graphs = getattr(runner, "decode_cuda_graph_runner", None)
    return graphs is not None and graphs is not getattr(runner, "eager_runner", None)


def build_width_runners(runner: Any, budgets: Sequence[int]) -> dict[int, WidthRunner]:
    """A :class:`WidthRunner` for every budget but the widest (the target's own runtime), built after
    SGLang's captures and before the round's own graphs."""
    from sglang.srt.runtime_context import get_spec

    from ddtree_runtime.sglang_plugin.algorithm import verify_width

    out: dict[int, WidthRunner] = {}
    for budget in sorted(budgets)[:-1]:
        rows = budget + 1
        with get_spec().override(speculative_num_draft_tokens=rows), verify_width(rows):
            saved = runner.init_new_workspace
            try:
                backend = runner._get_attention_backend(init_new_workspace=True)
            finally:
                runner.init_new_workspace = saved
            graph_runner = None
            if _captures(runner):
                graph_cls = runner._decode_cuda_graph_runner_cls()
                with bound(runner, WidthRunner(rows, backend)):
                    graph_runner = graph_cls(runner, attn_backend=backend, speculative_num_steps=1,
                                             speculative_num_draft_tokens=rows)  # fmt: skip
        out[budget] = WidthRunner(rows, backend, graph_runner)
        logger.info("DDTREE: width %d (%d verify rows): its own attention backend%s", budget, rows,
                    " and verify graphs" if graph_runner is not None else "")  # fmt: skip
    return out


@contextmanager
def bound(runner: Any, width: WidthRunner | None) -> Iterator[None]:
    """The target's model runner with ``width``'s backend (and graphs, where captured) while inside; the
    widest width's runtime (untouched) when ``width`` is None. The hook answers the width's verify rows
    meanwhile (SGLang's eager forwards size their buffers by it)."""
    if width is None:
        yield
        return
    from ddtree_runtime.sglang_plugin.algorithm import verify_width

    saved = runner.attn_backend, runner.decode_cuda_graph_runner
    runner.attn_backend = width.attn_backend
    if width.graph_runner is not None:
        runner.decode_cuda_graph_runner = width.graph_runner
    try:
        with verify_width(width.rows):
            yield
    finally:
        runner.attn_backend, runner.decode_cuda_graph_runner = saved
