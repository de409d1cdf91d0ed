"""Cost of Triton primitives inside one program (device micro-benchmark for kernel design).

Each kernel repeats one primitive REP times on register data in a single program; prints one JSON
line per case with microseconds per repetition (median of several launches).
"""

from __future__ import annotations

import functools
import json
import statistics

import torch
import triton
import triton.language as tl

from ddtree_runtime.bench import _eager_times
from ddtree_runtime.core.kernels.build import _pick  # the build heap's own 7-field combine


@triton.jit
def _topk_k(x_ptr, out_ptr, REP: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))
    acc = tl.zeros([K], tl.int64)
    for i in range(REP):
        t = tl.topk(x ^ i, K)
        acc += t
    tl.store(out_ptr + tl.arange(0, K), acc)


@triton.jit
def _sort_k(x_ptr, out_ptr, REP: tl.constexpr, N: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))
    acc = tl.zeros([N], tl.int64)
    for i in range(REP):
        acc += tl.sort(x ^ i, descending=True)
    tl.store(out_ptr + tl.arange(0, N), acc)


@triton.jit
def _hist_k(x_ptr, out_ptr, REP: tl.constexpr, N: tl.constexpr, BINS: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N)).to(tl.int32)
    acc = tl.zeros([BINS], tl.int32)
    for i in range(REP):
        acc += tl.histogram((x ^ i) & (BINS - 1), BINS)
    tl.store(out_ptr + tl.arange(0, BINS), acc)


@triton.jit
def _cumsum_k(x_ptr, out_ptr, REP: tl.constexpr, N: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N)).to(tl.int32)
    acc = tl.zeros([N], tl.int32)
    for i in range(REP):
        acc += tl.cumsum((x ^ i) & 1, axis=0)
    tl.store(out_ptr + tl.arange(0, N), acc)


@triton.jit
def _reduce7_k(x_ptr, out_ptr, REP: tl.constexpr, N: tl.constexpr):
    sl = tl.arange(0, N)
    s = tl.load(x_ptr + sl).to(tl.float64)
    w = tl.load(x_ptr + sl)
    tot = tl.zeros([], tl.float64)
    for _i in range(REP):
        bs, b0, b1, b2, bp, bm, slot = tl.reduce((s, w, w, w, s, w, sl), 0, _pick)
        s = tl.where(sl == slot, s - 1.0, s)
        tot += bs + bp + (b0 + b1 + b2 + bm).to(tl.float64)
    tl.store(out_ptr, tot.to(tl.int64))


@triton.jit
def _max1_k(x_ptr, out_ptr, REP: tl.constexpr, N: tl.constexpr):
    sl = tl.arange(0, N)
    s = tl.load(x_ptr + sl).to(tl.float64)
    tot = tl.zeros([], tl.float64)
    for _i in range(REP):
        b = tl.max(s, axis=0)
        slot = tl.min(tl.where(s == b, sl, N), axis=0)
        s = tl.where(sl == slot, s - 1.0, s)
        tot += b
    tl.store(out_ptr, tot.to(tl.int64))


def timeit(fn, n=7) -> float:
    return statistics.median(_eager_times(fn, n))


def main() -> None:
    dev = "cuda"
    x = torch.randint(0, 2**40, (8192,), device=dev, dtype=torch.int64)
    out = torch.empty(8192, device=dev, dtype=torch.int64)
    out32 = torch.empty(8192, device=dev, dtype=torch.int32)
    rep = 64

    def emit(name, us_total, **kw):
        print(json.dumps({"prim": name, "us_per_rep": round(us_total / rep, 3), **kw}), flush=True)

    for n, k, w in [
        (256, 64, 4),
        (1024, 64, 4),
        (2048, 64, 8),
        (4096, 64, 8),
        (4096, 1024, 8),
        (2048, 1024, 8),
    ]:
        emit(
            "topk_i64",
            timeit(functools.partial(_topk_k[(1,)], x, out, REP=rep, N=n, K=k, num_warps=w)),
            n=n,
            k=k,
            warps=w,
        )
    for n, w in [(64, 4), (1024, 8), (2048, 8)]:
        emit(
            "sort_i64",
            timeit(functools.partial(_sort_k[(1,)], x, out, REP=rep, N=n, num_warps=w)),
            n=n,
            warps=w,
        )
    for n, bins, w in [(2048, 256, 4), (4096, 256, 8), (4096, 2048, 8), (2048, 2048, 4)]:
        emit(
            "histogram",
            timeit(functools.partial(_hist_k[(1,)], x, out32, REP=rep, N=n, BINS=bins, num_warps=w)),
            n=n,
            bins=bins,
            warps=w,
        )
    for n, w in [(2048, 4), (4096, 8)]:
        emit(
            "cumsum_i32",
            timeit(functools.partial(_cumsum_k[(1,)], x, out32, REP=rep, N=n, num_warps=w)),
            n=n,
            warps=w,
        )
    for n, w in [(64, 1), (64, 2), (1024, 1), (1024, 4)]:
        emit(
            "reduce7",
            timeit(functools.partial(_reduce7_k[(1,)], x, out, REP=rep, N=n, num_warps=w)),
            n=n,
            warps=w,
        )
        emit(
            "max_then_slot",
            timeit(functools.partial(_max1_k[(1,)], x, out, REP=rep, N=n, num_warps=w)),
            n=n,
            warps=w,
        )
    # graph launch overhead: a chain of 16 tiny kernels in one CUDA graph
    y = torch.zeros(16, device=dev)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y.add_(1)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(16):
            y.add_(1)
    emit("graph_16_tiny_kernels", timeit(g.replay) * rep / 16)


if __name__ == "__main__":
    main()
