"""Test-only (``DDTREE_LAB_SYNC_WATCH=1``): count the host syncs inside each speculative decode forward.

SGLang's overlap scheduler prepares round n+1 while round n runs on the GPU; a device-to-host read
inside the worker's ``forward_batch_generation`` stalls it every round. This wraps the decode forward
of ``DDTreeWorker`` (trees) and ``DFlashWorkerV2`` (DFLASH's chain, for comparison) in CUDA's sync
debug mode (``torch.cuda.set_sync_debug_mode("warn")``: every synchronizing CUDA call warns) and logs
one line per decode forward: ``DDTREE_LAB_SYNC {"worker": ..., "bs": ..., "syncs": N, "sites": [...],
"compiles": M, "compiled": [...]}`` with the Python frames that issued the first syncs, and the Triton
kernels compiled (loaded into the process for a new specialization: Triton's post-compile hook) during
that forward, which a server that warmed its round at start-up never does under traffic (issue 40).
The device suite reads these lines from the server's log (tests/gpu/test_real_server_gpu.py). Prefill
and idle forwards are not counted.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

ENV = "DDTREE_LAB_SYNC_WATCH"
TAG = "DDTREE_LAB_SYNC"
_active = False  # a DDTREE chain forward runs DFlashWorkerV2's: count it once
_compiled: list[str] = []  # every Triton kernel this process compiled, in order (the hook below)


def _count_compiles() -> None:
    """Chain a recorder onto Triton's post-compile hook (called once per new specialization)."""
    from triton import knobs

    previous = knobs.runtime.jit_post_compile_hook

    def record(*args: Any, **kwargs: Any) -> Any:
        fn = kwargs.get("fn")  # Triton's JitFunctionInfo(module, name, jit_function)
        _compiled.append(f"{getattr(fn, 'module', '?')}.{getattr(fn, 'name', fn)}")
        return previous(*args, **kwargs) if previous is not None else False

    knobs.runtime.jit_post_compile_hook = record


def _is_decode(batch: Any) -> bool:
    mode = batch.forward_mode
    return not (mode.is_extend() or batch.is_extend_in_batch or mode.is_idle())


def watched(forward: Callable[..., Any], worker: str) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        global _active
        if _active or not _is_decode(batch):
            return forward(self, batch, *args, **kwargs)
        import torch

        _active = True
        compiled_before = len(_compiled)
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    out = forward(self, batch, *args, **kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        finally:
            _active = False
        syncs = [w for w in seen if "synchronizing CUDA operation" in str(w.message)]
        sites = [f"{os.path.basename(w.filename)}:{w.lineno}" for w in syncs[:4]]
        compiled = _compiled[compiled_before:]
        record = {"worker": worker, "bs": len(batch.reqs), "syncs": len(syncs), "sites": sites,
                  "compiles": len(compiled), "compiled": compiled[:8]}  # fmt: skip
        print(TAG, json.dumps(record), file=sys.stderr, flush=True)  # the server's log
        return out

    return run


def _wrap(cls_name: str, label: str) -> Callable[[ModuleType], None]:
    def apply(module: ModuleType) -> None:
        cls = getattr(module, cls_name)
        cls.forward_batch_generation = watched(cls.forward_batch_generation, label)

    return apply


def parse(log: str) -> list[dict[str, Any]]:
    """The records of a server log, in order."""
    out = []
    for line in log.splitlines():
        at = line.find(TAG + " ")
        if at >= 0:
            out.append(json.loads(line[at + len(TAG) + 1 :]))
    return out


def install() -> None:
    if os.environ.get(ENV) != "1":
        return
    from ddtree_sglang_cpu_lab.base.hooks import after_import

    _count_compiles()
    after_import("ddtree_runtime.sglang_plugin.ddtree_worker", _wrap("DDTreeWorker", "DDTREE"))
    after_import("sglang.srt.speculative.dflash_worker_v2", _wrap("DFlashWorkerV2", "DFLASH"))
