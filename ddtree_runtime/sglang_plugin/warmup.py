"""``ddtree_batches``: a start-up warm-up (SGLang's ``--warmups``) that runs tree rounds at every
batch size the server captured graphs for, greedy and sampled, before the server says ready.

Triton compiles a kernel the first time it meets a new specialization, and some of the kernels a
decode round launches specialise on the batch (SGLang's load-batch copies into the graphs' static
buffers, its Gated DeltaNet state scatter, ...). SGLang's own warm-up is one request, so a fresh
server compiled them on live traffic, 0.3-0.7 s each, at every new batch size (issue 40). The tree
round's own kernels are compiled when its graphs are captured (``round.round_graphs``); this warm-up
sends ``n`` concurrent short requests for each captured batch size ``n`` so what SGLang compiles
lazily is compiled too. The plugin adds it to ``--warmups`` for tree configurations
(``algorithm.resolve_server_args``); SGLang runs it before the server listens.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from typing import Any

from ddtree_runtime.sglang_plugin.names import RESOLVED_ATTR

logger = logging.getLogger(__name__)

NAME = "ddtree_batches"
NEW_TOKENS = 4  # a few decode rounds at the batch size
PROMPT_TOKENS = 8
FALLBACK_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16)
# Its requests' ids start so: an adaptive server's width choice cycles its widths on them, uncounted
# (round/width_choice.py).
RID_PREFIX = "ddtree-warmup-"


def warmup_sizes(capture_bs: Any, max_running: int | None) -> list[int]:
    """The batch sizes to warm: SGLang's decode capture sizes up to the running-request limit, and
    for each one a batch one smaller, which pads into it (a padded replay launches its own kernel
    variants: on the H100 a batch of 15 in the bucket of 16 compiled SGLang's state-index kernel)."""
    captured = [int(b) for b in (capture_bs or FALLBACK_SIZES)]
    if max_running:
        captured = [b for b in captured if b <= int(max_running)] or [int(max_running)]
    padded = [b - 1 for b in captured if b > 1]
    return sorted(set(captured) | set(padded))


def warmup_widths(server_args: Any) -> tuple[int | None, ...]:
    """An adaptive server's widths, each warmed at every size (its rounds take the width its requests' ids
    name: ``round/width_choice``); (None,) for one width."""
    settings = getattr(server_args, RESOLVED_ATTR, None) if server_args is not None else None
    decoder = getattr(settings, "decoder", None)
    return decoder.budgets if decoder is not None and decoder.adaptive else (None,)


def wanted(device: Any, disable_cuda_graph: Any) -> bool:
    """Warm where kernels compile per batch size: CUDA with graphs (not the CPU lab, where Triton
    interprets and a warm-up would only lengthen every start)."""
    return str(device or "").startswith("cuda") and not disable_cuda_graph


def with_warmup(warmups: str | None) -> str:
    """``--warmups`` with ``ddtree_batches`` added once, after the operator's own."""
    names = [n for n in (warmups or "").split(",") if n]
    return ",".join(names if NAME in names else [*names, NAME])


async def _drain(generator: Any) -> None:
    async for _ in generator:
        pass


async def ddtree_batches(disaggregation_mode: str, tokenizer_manager: Any) -> None:
    """Never stops a start: a warm-up that fails leaves the compiles to the first traffic, logged."""
    try:
        await _warm_batches(disaggregation_mode, tokenizer_manager)
    except Exception as exc:  # a warm-up must not fail the server's start
        logger.warning(
            "DDTREE warm-up did not finish (%s: %s); kernels compile on first traffic",
            type(exc).__name__,
            exc,
        )


async def _warm_batches(disaggregation_mode: str, tokenizer_manager: Any) -> None:
    from sglang.srt.managers.io_struct import GenerateReqInput

    try:
        from sglang.srt.runtime_context import get_exec

        capture_bs = get_exec().graph.cuda_graph_config.decode.bs
    except Exception:  # the capture list is not known in this process: warm the usual sizes
        capture_bs = None
    max_running = getattr(getattr(tokenizer_manager, "server_args", None), "max_running_requests", None)
    sizes = warmup_sizes(capture_bs, max_running)
    vocab = int(getattr(getattr(tokenizer_manager, "model_config", None), "vocab_size", 1000))
    rng = random.Random(0)
    widths = warmup_widths(getattr(tokenizer_manager, "server_args", None))
    logger.info("DDTREE warm-up: tree rounds at batch sizes %s, greedy and sampled%s", sizes,
                f", at each of the widths {list(widths)}" if widths != (None,) else "")  # fmt: skip
    for width, n, temperature in itertools.product(widths, sizes, (0.0, 1.0)):
        params = {"max_new_tokens": NEW_TOKENS, "temperature": temperature, "ignore_eos": True}
        requests = [
            GenerateReqInput(
                input_ids=[rng.randrange(10, max(11, vocab - 1)) for _ in range(PROMPT_TOKENS)],
                sampling_params=dict(params),
                rid=f"{RID_PREFIX}{width or 'x'}-{n}-{temperature}-{i}-{rng.getrandbits(32):08x}",
            )
            for i in range(n)
        ]
        if disaggregation_mode != "null":
            from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

            for req in requests:
                req.bootstrap_room, req.bootstrap_host = 0, FAKE_BOOTSTRAP_HOST
        await asyncio.gather(*(_drain(tokenizer_manager.generate_request(r, None)) for r in requests))


def register_warmup() -> None:
    """Make ``ddtree_batches`` a name ``--warmups`` accepts (every process; the HTTP server runs it)."""
    from sglang.srt.entrypoints.warmup import warmup

    warmup(NAME)(ddtree_batches)
