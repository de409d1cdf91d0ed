"""What the start-up price table times for a ``DDTreeWorker`` (``price_table.measure_prices``): at each batch
size, the server's own passes on dummy inputs, as SGLang's capture and warm-up run them.

* verify: the target's verify at the tree's width (budget + 1 rows a request): the CUDA graph SGLang
  captured for that batch size, replayed on its static buffers; without one, SGLang's own eager dummy
  forward in TARGET_VERIFY mode (``_dummy_run``, what its autotune warm-up runs).
* rest of the round: the drafter's block pass as the round runs it (``SGLangRoundModels.draft_hidden``
  on dummy requests: SGLang's runner replays its captured graph or runs eagerly), then the round's plan
  and accept stages (``round_graphs.RoundBucket.replay_stages``: the
  round's graphs where they were captured, else the same stage functions eagerly on a bucket built for
  pricing). Not timed: SGLang's batch staging into the graphs' buffers and the drafter's context append.

The dummy inputs are what SGLang's capture left in its static buffers (sequence lengths at its fill value,
cache locations 0: SGLang's dummy slot), so a price is the round at a short context: attention over a long
prefix is not in it. Runs only at start-up, before the server says ready.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ddtree_runtime.sglang_plugin.round.round_graphs import GraphSpec, RoundGraphs
from ddtree_runtime.sglang_plugin.round.tree_round import RoundConfig

logger = logging.getLogger(__name__)

EAGER_SIZES = (1, 2, 4, 8)  # batch sizes priced where nothing was captured (CPU, --disable-cuda-graph)


def forward_at(
    runner: Any, max_bs: int, *, rows: int | None = None
) -> tuple[Callable[[int], Callable[[], object]], bool]:
    """``bs -> run`` for one model runner's verify-shaped forward, and whether it replays a CUDA graph
    (every size ``graph_sizes`` lists has one) or runs eagerly. ``rows``: a narrower width of an adaptive
    server (verify rows a request), whose verify SGLang captured no graph for: eager, at that width."""
    from ddtree_runtime.sglang_plugin.algorithm import verify_width

    graph_runner = getattr(runner, "decode_cuda_graph_runner", None)
    backend = getattr(graph_runner, "backend", None)
    eager = getattr(runner, "eager_runner", None)
    if backend is not None and graph_runner is not eager and rows is None:
        from sglang.srt.model_executor.runner.shape_key import ShapeKey

        def replay(bs: int) -> Callable[[], object]:
            key = ShapeKey(size=bs)
            if not backend.can_run(None, key):
                raise LookupError(f"no captured graph at batch size {bs}")
            return lambda: backend.replay(key, None)

        return replay, True
    if eager is None:
        raise LookupError("the model runner has neither captured graphs nor an eager runner")
    with _fill_value(runner.attn_backend), verify_width(rows):
        width = runner.decode_num_tokens_per_req()
        buffers = eager._alloc_dummy_decode_buffers(max_bs, num_tokens_per_req=width)

    def dummy(bs: int) -> Callable[[], object]:
        def run() -> object:
            with verify_width(rows):  # SGLang's dummy forward sizes its verify by the hook's answer
                return eager._dummy_run(bs, buffers=buffers)

        return run

    return dummy, False


@contextmanager
def _fill_value(backend: Any) -> Iterator[None]:
    """SGLang's dummy buffers start each request's length at the backend's CUDA-graph fill value; a backend
    with no graphs (torch_native: the CPU lab) has none, and 1 (one token of context) stands in."""
    try:
        backend.get_cuda_graph_seq_len_fill_value()
    except NotImplementedError:
        backend.get_cuda_graph_seq_len_fill_value = lambda: 1
        try:
            yield
        finally:
            del backend.get_cuda_graph_seq_len_fill_value
        return
    yield


def pricing_graphs(worker: Any, cfg: RoundConfig, sizes: list[int], device: torch.device) -> RoundGraphs:
    """The round's stages on buckets of their own, eager (where the round captured no graphs): the worker's
    head and KV pool, a private mask buffer (a bucket's tree cells at prefix 0)."""
    from ddtree_runtime.sglang_plugin.round.draft_head import draft_head

    runner = worker.target_worker.model_runner
    lm_head = runner.model.lm_head
    vocab = int(worker.model_runner.model_config.vocab_size)
    max_bs = max(sizes)

    def head(rows: torch.Tensor) -> torch.Tensor:
        return draft_head(rows, lm_head, vocab, None, budget=cfg.budget, topk_cap=cfg.topk_cap)

    spec = GraphSpec(
        cfg=cfg,
        head=head,
        hidden_size=int(worker.draft_model.config.hidden_size),
        hidden_dtype=getattr(worker.draft_model_runner, "dtype", None) or torch.float32,
        kv_pool=runner.token_to_kv_pool,
        mask_buffer=torch.zeros(max_bs * cfg.verify_rows**2, dtype=torch.uint8, device=device),
        mask_max_bs=max_bs,
    )
    graphs = RoundGraphs(spec, device, capture=False)
    graphs.build(sizes)
    return graphs


def drafter_at(
    worker: Any, cfg: RoundConfig, bs: int, device: torch.device, *, graphs: bool
) -> Callable[[], object]:
    """The drafter's block pass as the round runs it (``SGLangRoundModels.draft_hidden``: its captured graph
    where SGLang has one for ``bs``, else eager) for ``bs`` dummy requests: each at one token of context in
    request row 0, its block written to slot 0 (SGLang's dummy slot)."""
    from types import SimpleNamespace

    from ddtree_runtime.sglang_plugin.round.sglang_models import SGLangRoundModels
    from ddtree_runtime.sglang_plugin.round.tree_round import draft_block_inputs

    prefix = torch.ones(bs, dtype=torch.long, device=device)
    batch = SimpleNamespace(seq_lens=prefix, seq_lens_cpu=torch.ones(bs, dtype=torch.long),
                            can_run_decode_cuda_graph=graphs)  # fmt: skip
    models = SGLangRoundModels(worker, batch)
    root = torch.zeros(bs, dtype=torch.long, device=device)
    block_ids, positions = draft_block_inputs(root, prefix, cfg.block_size, cfg.mask_token_id)
    cache_loc = torch.zeros(bs * cfg.block_size, dtype=torch.long, device=device)
    rows = torch.zeros(bs, dtype=torch.long, device=device)
    return lambda: models.draft_hidden(block_ids, positions, cache_loc, rows)


def worker_stages(
    worker: Any, cfg: RoundConfig, graphs: RoundGraphs | None, *, sizes: list[int] | None = None,
    rows: int | None = None,
) -> tuple[
    list[int], Callable[[int], tuple[Callable[[], object], Callable[[], object]]], str, Callable[[], None]
]:  # fmt: skip
    """(batch sizes, ``bs -> (verify, rest)``, method, device sync) for a tree worker. The sizes are
    ``sizes`` where given (an adaptive server prices every width at its widest one's), else the round
    graphs' buckets where they were captured, else :data:`EAGER_SIZES` up to the running limit. ``rows``:
    a narrower width's verify rows (:func:`forward_at`)."""
    runner = worker.target_worker.model_runner
    device = torch.device(runner.device if isinstance(runner.device, str) else str(runner.device))
    if sizes is not None:
        sizes = sorted(sizes)
    elif graphs is not None and graphs.buckets:
        sizes = sorted(graphs.buckets)
    else:
        limit = int(getattr(runner.req_to_token_pool, "size", 0) or max(EAGER_SIZES))
        sizes = [s for s in EAGER_SIZES if s <= limit] or [1]
    verify_at, verify_graphs = forward_at(runner, max(sizes), rows=rows)
    own = graphs is not None and graphs.buckets and all(s in graphs.buckets for s in sizes)
    stages = graphs if own else pricing_graphs(worker, cfg, sizes, device)
    method = "graphs" if verify_graphs and own else "eager"
    graph_runner = getattr(runner, "decode_cuda_graph_runner", None)
    # The drafter's block replays its graph where SGLang captured any (what a served round does).
    drafter_graphs = getattr(graph_runner, "backend", None) is not None and graph_runner is not getattr(
        runner, "eager_runner", None
    )

    def at(bs: int) -> tuple[Callable[[], object], Callable[[], object]]:
        draft, bucket = drafter_at(worker, cfg, bs, device, graphs=drafter_graphs), stages.buckets[bs]

        def rest() -> None:
            draft()
            bucket.replay_stages()

        return verify_at(bs), rest

    sync = torch.cuda.synchronize if device.type == "cuda" else _no_sync
    return sizes, at, method, sync


def _no_sync() -> None:
    """CPU: every op has finished when it returns."""
