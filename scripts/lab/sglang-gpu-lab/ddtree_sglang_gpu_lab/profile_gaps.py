"""Where a speculative round's time goes, from a torch-profiler trace SGLang wrote (``/start_profile``).

SGLang labels every model-runner forward ``step[VERIFY bs=N]`` (the target's verify) or
``step[DRAFT bs=N]`` (any draft-runner forward); the profiler maps those labels onto the GPU
(``gpu_user_annotation``). From the trace: the GPU window and its busy union, so the GPU-idle time
per round; the GPU time inside VERIFY and DRAFT spans per round; and the host syncs (stream/event/
device synchronize, device-to-host copies) with the Python frame of ours or SGLang's that issued each
(the trace needs ``with_stack``); and the GPU time of each stage (VERIFY, DRAFT, between them) by
kernel family and by kernel name. Numbers are under the profiler, which slows the host: compare
DDTREE with DFLASH from traces taken the same way, not with untraced timings.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
COPY_CALLS = ("cudaMemcpyAsync", "cudaMemcpy")
STEP = re.compile(r"step\[(\w+) bs=(\d+)")
# Frames worth naming: the plugin's and SGLang's (not torch's or the standard library's).
OWN_FRAME = re.compile(r"(ddtree_runtime|sglang/srt)/[\w/]+\.py\(\d+\)")


def load_trace(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        doc = json.load(fh)
    return [e for e in doc.get("traceEvents", doc if isinstance(doc, list) else []) if e.get("ph") == "X"]


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def merged_starts(intervals: Iterable[tuple[float, float]]) -> list[float]:
    """The start of each group of overlapping intervals (one forward's spans on several streams)."""
    starts: list[float] = []
    end = float("-inf")
    for start, stop in sorted(intervals):
        if start > end:
            starts.append(start)
        end = max(end, stop)
    return starts


def _frames_by_thread(events: list[dict[str, Any]]) -> dict[Any, tuple[list[float], list[dict[str, Any]]]]:
    by_tid: dict[Any, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("cat") == "python_function":
            by_tid.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    out = {}
    for key, frames in by_tid.items():
        frames.sort(key=lambda f: f["ts"])
        out[key] = ([f["ts"] for f in frames], frames)
    return out


def issuing_frame(call: dict[str, Any], frames: dict[Any, tuple[list[float], list[dict[str, Any]]]]) -> str:
    """The innermost plugin or SGLang frame enclosing ``call`` on its thread ('?' without a stack)."""
    starts, evs = frames.get((call.get("pid"), call.get("tid")), ([], []))
    end = call["ts"] + call.get("dur", 0)
    last = bisect.bisect_right(starts, call["ts"]) - 1
    for f in reversed(evs[max(0, last - 50000) : last + 1]):  # nearest start first: the innermost
        match = OWN_FRAME.search(f["name"])
        if match and f["ts"] + f.get("dur", 0) >= end:
            return f["name"][match.start() :]
    return "?"


# Kernel families, first match wins (names lowercased): enough to say where a verify's time goes;
# the raw names come with them (``top_kernels``), since SGLang's and Triton's names change by release.
KERNEL_FAMILIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "gdn",
        re.compile(
            r"gated_delta|delta_rule|fused_recurrent|causal_conv|conv1d|gdn|mamba|ssm"
            r"|chunk_scaled"
        ),
    ),
    ("gemm", re.compile(r"gemm|xmma|cutlass|nvjet|cublas|matmul|wgmma|splitk|sm90_|sm80_")),
    ("attention", re.compile(r"attention|attn|flash|_fwd_kernel|fwd_grouped|decode_.*stage|extend")),
    ("norm", re.compile(r"norm")),
    ("topk_sort", re.compile(r"topk|top_k|sort|radix|argmax|bitonic")),
    (
        "tree",
        re.compile(
            r"_build_kernel|_compile_kernel|_walk_kernel|_commit_kernel|_lazy_step|_rank_kernel"
            r"|_chunk_kernel|_exact_kernel|_gather_kernel|tree"
        ),
    ),
    ("activation", re.compile(r"silu|gelu|act_and_mul|swiglu")),
    (
        "elementwise",
        re.compile(
            r"elementwise|vectorized|unrolled|reduce|index|scatter|gather|copy|fill"
            r"|cat_"
        ),
    ),
)


def kernel_family(name: str, category: str = "kernel") -> str:
    """The family a GPU event belongs to: memcpy / memset by category, kernels by name."""
    if category == "gpu_memcpy":
        return "memcpy"
    if category == "gpu_memset":
        return "memset"
    low = name.lower()
    return next((family for family, pattern in KERNEL_FAMILIES if pattern.search(low)), "other")


def _stage_of(ts: float, spans: dict[str, list[tuple[float, float]]]) -> str:
    for stage, intervals in spans.items():
        i = bisect.bisect_right(intervals, (ts, float("inf"))) - 1
        if i >= 0 and intervals[i][0] <= ts < intervals[i][1]:
            return stage
    return "between"  # outside every forward: the tree build, the walk, the commit, sampling


def kernel_breakdown(
    events: list[dict[str, Any]], stage_spans: dict[str, list[tuple[float, float]]],
    lo: float, hi: float, rounds: int, top: int = 12,
) -> dict[str, Any]:  # fmt: skip
    """GPU time per round by stage (VERIFY, DRAFT, between) and kernel family, with each stage's
    costliest kernel names (ms and launches per round). A kernel belongs to the stage whose GPU span
    holds its start; spans of one stage may overlap (one per stream), so they are merged first."""
    merged: dict[str, list[tuple[float, float]]] = {}
    for stage, intervals in stage_spans.items():
        out: list[tuple[float, float]] = []
        for start, stop in sorted(intervals):
            if out and start <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], stop))
            else:
                out.append((start, stop))
        merged[stage] = out
    family_us: dict[str, Counter[str]] = {}
    name_us: dict[str, Counter[str]] = {}
    name_calls: dict[str, Counter[str]] = {}
    for e in events:
        cat = e.get("cat")
        if cat not in GPU_CATEGORIES or not lo <= e["ts"] < hi:
            continue
        stage = _stage_of(e["ts"], merged)
        dur = float(e.get("dur", 0))
        name = e.get("name", "")
        family_us.setdefault(stage, Counter())[kernel_family(name, cat)] += dur
        name_us.setdefault(stage, Counter())[name[:120]] += dur
        name_calls.setdefault(stage, Counter())[name[:120]] += 1

    def per_round(us: float) -> float:
        return round(us / 1000 / rounds, 4)

    return {
        stage: {
            "kernel_ms": per_round(sum(family_us[stage].values())),
            "families_ms": {k: per_round(v) for k, v in family_us[stage].most_common()},
            "top_kernels": [
                {
                    "name": k,
                    "ms": per_round(v),
                    "calls": round(name_calls[stage][k] / rounds, 2),
                    "family": kernel_family(k),
                }
                for k, v in name_us[stage].most_common(top)
            ],
        }
        for stage in sorted(family_us)
    }


def _clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def analyse(path: Path) -> dict[str, Any]:
    """One trace's figures per round, over the rounds between its first and its last verify.

    The window runs from the first VERIFY span's start to the last one's (on the GPU for the GPU
    figures, on the host for the host calls), so a prefill or the wait for a request is not counted.
    """
    events = load_trace(path)
    verify_gpu = merged_starts(
        (e["ts"], e["ts"] + e.get("dur", 0))
        for e in events
        if e.get("cat") == "gpu_user_annotation" and e.get("name", "").startswith("step[VERIFY")
    )
    verify_cpu = sorted(
        e["ts"]
        for e in events
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith("step[VERIFY")
    )
    if len(verify_gpu) < 2 or len(verify_cpu) < 2:
        return {
            "trace": path.name,
            "error": f"{len(verify_gpu)} verify spans on the GPU, {len(verify_cpu)} on the host",
        }
    c_lo, c_hi = verify_cpu[0], verify_cpu[-1]
    # A round is one host-side VERIFY span: the profiler writes a GPU span per stream the forward
    # used, so the GPU spans may be more than the forwards.
    rounds = len(verify_cpu) - 1
    g_lo, g_hi = verify_gpu[0], verify_gpu[-1]
    gpu = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") in GPU_CATEGORIES]
    busy = union_length(_clip(gpu, g_lo, g_hi))
    window = g_hi - g_lo
    stage_spans: dict[str, list[tuple[float, float]]] = {}
    steps: Counter[str] = Counter()
    batch_sizes: Counter[int] = Counter()
    for e in events:
        match = STEP.match(e.get("name", ""))
        if not match:
            continue
        stage = match.group(1)
        if e.get("cat") == "gpu_user_annotation" and g_lo <= e["ts"] < g_hi:
            stage_spans.setdefault(stage, []).append((e["ts"], e["ts"] + e.get("dur", 0)))
        elif e.get("cat") == "user_annotation" and c_lo <= e["ts"] < c_hi:
            steps[stage] += 1
            if stage == "VERIFY":
                batch_sizes[int(match.group(2))] += 1
    # GPU-side windows (the union of each stage's spans), with the kernel time the GPU spent in them.
    stage_window_us = {k: union_length(v) for k, v in stage_spans.items()}
    correlation_kind = {
        e.get("args", {}).get("correlation"): e.get("name", "")
        for e in events
        if e.get("cat") == "gpu_memcpy"
    }
    frames = _frames_by_thread(events)
    sync_sites: Counter[str] = Counter()
    sync_us = 0.0
    syncs = copies_dtoh = 0
    for e in events:
        if e.get("cat") != "cuda_runtime" or not c_lo <= e["ts"] < c_hi:
            continue
        name = e.get("name", "")
        if name in SYNC_CALLS:
            syncs += 1
        elif name in COPY_CALLS and "DtoH" in correlation_kind.get(e.get("args", {}).get("correlation"), ""):
            copies_dtoh += 1
        else:
            continue
        sync_us += e.get("dur", 0)
        sync_sites[f"{name} @ {issuing_frame(e, frames)}"] += 1
    return {
        "trace": path.name,
        "rounds": rounds,
        "verify_batch_sizes": dict(batch_sizes),
        "steps": dict(steps),
        "round_ms": round(window / 1000 / rounds, 3),
        "gpu_idle_per_round_ms": round((window - busy) / 1000 / rounds, 3),
        "gpu_ms_per_round": {k: round(v / 1000 / rounds, 3) for k, v in stage_window_us.items()},
        "host_syncs_per_round": round(syncs / rounds, 2),
        "dtoh_copies_per_round": round(copies_dtoh / rounds, 2),
        "host_wait_per_round_ms": round(sync_us / 1000 / rounds, 3),
        "sync_sites_per_round": {k: round(v / rounds, 2) for k, v in sync_sites.most_common(25)},
        "kernels_per_round": kernel_breakdown(events, stage_spans, g_lo, g_hi, rounds),
    }
