"""Drive a running SGLang server over HTTP at a fixed concurrency and print what it delivered.

``python -m ddtree_runtime.bench server --url URL [--concurrency 1 4 16] [--requests N] [--repeats R]``

Each request streams ``/generate`` (T = 0 unless ``--temperature``), so time to first token is the
first chunk's arrival; ``meta_info`` gives completion tokens and, for a speculative server, verify steps
(``spec_verify_ct``). Per concurrency level and repeat: aggregate output tokens/s (all tokens over the
wall time), per-request tokens/s (median), TTFT (median, p90), acceptance length (tokens over verify
steps). One JSON line per (concurrency, repeat), then one summary line per concurrency with medians over
the repeats. The output ids of every request are kept (``--ids-out``) so the caller can check them
against another server's: a benchmark of a wrong decoder counts for nothing.

Stdlib only, through the health tools' SGLang client (``sglang_client.stream_generate``): it runs on a
bare GPU host next to the server.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ddtree_runtime.health import sglang_client

MAX_CONCURRENCY = 256
MAX_REQUESTS = 100_000


@dataclass
class RequestResult:
    prompt_index: int
    ttft_s: float
    e2e_s: float
    completion_tokens: int
    verify_steps: int
    output_ids: list[int] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.e2e_s if self.e2e_s > 0 else 0.0


def stream_generate(
    url: str, prompt: str, max_new_tokens: int, temperature: float, timeout: float
) -> dict[str, Any]:
    """One streamed /generate: time to the first chunk, the last chunk's meta_info and output ids."""
    payload = {
        "text": prompt, "stream": True,
        "sampling_params": {"temperature": temperature, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }  # fmt: skip
    stream = sglang_client.stream_generate(url, payload, timeout=timeout)
    last = stream.last
    meta = last.get("meta_info") or {}
    return {
        "ttft_s": stream.ttft_s, "e2e_s": stream.e2e_s,
        "completion_tokens": int(meta.get("completion_tokens") or 0),
        "verify_steps": int(meta.get("spec_verify_ct") or 0),
        "output_ids": list(last.get("output_ids") or []),
    }  # fmt: skip


def run_level(
    url: str,
    prompts: Sequence[str],
    *,
    concurrency: int,
    requests: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    timeout: float = 600.0,
) -> tuple[list[RequestResult], float]:
    """``requests`` requests over ``prompts`` (round robin), ``concurrency`` in flight at a time."""
    if not 1 <= concurrency <= MAX_CONCURRENCY:
        raise ValueError(f"concurrency {concurrency}: choose 1 to {MAX_CONCURRENCY}")
    if not 1 <= requests <= MAX_REQUESTS:
        raise ValueError(f"requests {requests}: choose 1 to {MAX_REQUESTS}")
    results: list[RequestResult | None] = [None] * requests
    errors: list[BaseException] = []
    next_index = iter(range(requests))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None or errors:
                return
            try:
                doc = stream_generate(url, prompts[i % len(prompts)], max_new_tokens, temperature, timeout)
            except BaseException as exc:  # reported after the run
                errors.append(exc)
                return
            results[i] = RequestResult(prompt_index=i % len(prompts), **doc)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed at concurrency {concurrency}: {errors[0]}")
    return [r for r in results if r is not None], wall


def summarize(results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    tokens = sum(r.completion_tokens for r in results)
    steps = sum(r.verify_steps for r in results)
    ttfts = sorted(r.ttft_s for r in results)
    return {
        "requests": len(results), "tokens": tokens, "wall_s": round(wall_s, 4),
        "output_tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else 0.0,
        "per_request_tokens_per_s_median": round(statistics.median(r.tokens_per_s for r in results), 2),
        "ttft_ms_median": round(1000 * statistics.median(ttfts), 2),
        "ttft_ms_p90": round(1000 * ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))], 2),
        "verify_steps": steps, "accept_length": round(tokens / steps, 3) if steps else None,
    }  # fmt: skip


def bench_server(
    url: str,
    prompts: Sequence[str],
    *,
    levels: Sequence[int],
    requests_per_level: int | None = None,
    repeats: int = 3,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    label: str = "",
    emit: Any = print,
    warm_each_level: bool = True,
) -> dict[int, dict[str, Any]]:
    """Every level ``repeats`` times (one warm-up request first); returns the per-level medians and
    the output ids of the last repeat (by request index) under ``"ids"``.

    ``warm_each_level``: each level first runs once unmeasured (its line says ``server_warmup``). A
    server compiles kernels the first time it meets a batch size (Triton specialises on sizes: on the
    H200 a tree server's first pass at a new concurrency ran 0.68x its warm speed), so without it
    the first repeat times compiles, not rounds."""
    run_level(url, prompts[:1], concurrency=1, requests=1, max_new_tokens=8, temperature=temperature)
    summary: dict[int, dict[str, Any]] = {}
    for level in levels:
        n = requests_per_level or max(2 * level, len(prompts))
        if warm_each_level:
            results, wall = run_level(
                url, prompts, concurrency=level, requests=n, max_new_tokens=max_new_tokens,
                temperature=temperature,
            )  # fmt: skip
            row = summarize(results, wall)
            emit(json.dumps({"bench": "server_warmup", "server": label, "concurrency": level, **row}))
        rows = []
        ids: list[list[int]] = []
        for repeat in range(repeats):
            results, wall = run_level(
                url,
                prompts,
                concurrency=level,
                requests=n,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
            )
            row = summarize(results, wall)
            emit(
                json.dumps(
                    {"bench": "server", "server": label, "concurrency": level, "repeat": repeat, **row}
                )
            )
            rows.append(row)
            ids = [r.output_ids for r in results]
        summary[level] = {
            "output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in rows),
            "per_request_tokens_per_s_median": statistics.median(
                r["per_request_tokens_per_s_median"] for r in rows
            ),
            "ttft_ms_median": statistics.median(r["ttft_ms_median"] for r in rows),
            "accept_length": rows[-1]["accept_length"], "verify_steps": rows[-1]["verify_steps"],
            "requests": n, "repeats": repeats, "ids": ids,
        }  # fmt: skip
    return summary


def bench_phases(
    url: str,
    prompts: Sequence[str],
    *,
    phases: Sequence[int],
    requests_per_phase: int | None = None,
    repeats: int = 3,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    label: str = "",
    emit: Any = print,
) -> dict[str, Any]:
    """A load whose concurrency changes inside one run: the ``phases`` (``1 16 4 1``) back to back, nothing
    between them, ``repeats`` times; each repeat's tokens over its whole wall time (the server meets every
    change of load as traffic brings it: what an adaptive width is for). Returns the median, each phase's
    median tokens/s, and the last repeat's output ids per phase."""
    if not phases:
        raise ValueError("phases: give at least one concurrency")
    run_level(url, prompts[:1], concurrency=1, requests=1, max_new_tokens=8, temperature=temperature)
    runs: list[dict[str, Any]] = []
    ids: list[list[list[int]]] = []
    for repeat in range(repeats):
        rows, ids = [], []
        for level in phases:
            n = requests_per_phase or max(2 * level, len(prompts))
            results, wall = run_level(url, prompts, concurrency=level, requests=n,
                                      max_new_tokens=max_new_tokens, temperature=temperature)  # fmt: skip
            rows.append(summarize(results, wall))
            ids.append([r.output_ids for r in results])
        tokens, wall = sum(r["tokens"] for r in rows), sum(r["wall_s"] for r in rows)
        run = {"tokens": tokens, "wall_s": round(wall, 4),
               "output_tokens_per_s": round(tokens / wall, 2) if wall > 0 else 0.0,
               "phase_tokens_per_s": [r["output_tokens_per_s"] for r in rows]}  # fmt: skip
        emit(json.dumps({"bench": "server_phases", "server": label, "phases": list(phases), "repeat": repeat,
                         **run}))  # fmt: skip
        runs.append(run)
    return {
        "phases": list(phases), "repeats": repeats,
        "output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in runs),
        "phase_tokens_per_s": [statistics.median(r["phase_tokens_per_s"][i] for r in runs)
                               for i in range(len(phases))],
        "ids": ids,
    }  # fmt: skip
