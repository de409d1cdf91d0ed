"""Named cases against the real SGLang 0.5.23 server on the device H200, printing JSON lines.

``python -m ddtree_sglang_gpu_lab.cases CASE [CASE ...]`` (scripts/lab/gpu/device.sh runs it there):

* ``evidence``: for the dense and the hybrid lab pair, greedy DDTREE (this checkout's plugin, and the
  baseline plugin when ``DDTREE_GPU_LAB_BASELINE`` names one) and DFLASH against the same server
  without speculation, CUDA graphs on: per prompt at batch 1 and all prompts in one batch, whether
  the tokens are identical (else the first difference), and how many target verifies SGLang replayed
  from a graph (``SGLANG_LOG_DECODE_GRAPH_KEY=1``) against how many ran.
* ``probe``: ``ddtree probe live`` against each DDTREE server of the run.
* ``bench``: ``ddtree_runtime.health.server_bench`` at concurrency 1, 4 and 16 on plain decoding, DFLASH and
  DDTREE (budgets 16, 32, 64) for both pairs, one server measured at a time (the others idle with
  ``--sleep-on-idle``), the output ids checked against the plain server's at every level, tokens/s
  ratios against DFLASH from the same run.
* ``prod``: Qwen3.6-27B's shape with ``--load-format dummy`` (``prod_shape``), one server at a time
  (``DDTREE_GPU_LAB_PROD``, default ``dflash-fp32 ddtree16-fp32``): the benchmark at 1, 4 and 16,
  then SGLang's profiler over 24 steps at 1 and 16 (``profile_gaps``: time per round, GPU time in
  the draft and the verify, GPU idle and host syncs per round with the frame that issued each).

Servers start in two waves: the two plain servers first (they compile SGLang's run-time kernels into
the shared cache), then every other server at once; every server is stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddtree_runtime.health.prompts import CAPITAL
from ddtree_runtime.tiny_engine.language import LAB_PROMPTS
from ddtree_sglang_gpu_lab.server import GpuServer

# The lab language's prompts, the probe's first and a chat turn (one home each: ddtree_runtime's).
PROMPTS = (*LAB_PROMPTS, CAPITAL, "<|im_start|>user\nthe old fox watches<|im_end|>\n<|im_start|>assistant\n")
NEW_TOKENS = 64


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


@dataclass
class Spec:
    name: str
    pair: str
    algorithm: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)
    extra: list[str] = field(default_factory=list)


def _server(spec: Spec, models: Path, log_dir: Path) -> GpuServer:
    pair = models / spec.pair
    return GpuServer(
        spec.name, pair / "target", log_dir=log_dir, algorithm=spec.algorithm, draft=pair / "draft",
        hybrid=spec.pair in ("hybrid", "prod"), overrides=spec.overrides, extra=spec.extra,
        env={"SGLANG_LOG_DECODE_GRAPH_KEY": "1", **spec.env},
    )  # fmt: skip


def start_all(specs: list[Spec], models: Path, log_dir: Path) -> dict[str, GpuServer | Exception]:
    """Start ``specs`` at once; a server that fails to start is reported and left out."""
    servers: dict[str, GpuServer | Exception] = {}

    def one(spec: Spec) -> tuple[str, GpuServer | Exception]:
        t0 = time.monotonic()
        server = _server(spec, models, log_dir)
        try:
            server.wait_ready()
        except RuntimeError as exc:
            emit({"case": "start", "server": spec.name, "ok": False, "error": str(exc)[-1500:]})
            server.stop()
            return spec.name, exc
        emit({"case": "start", "server": spec.name, "ok": True, "seconds": round(time.monotonic() - t0, 1)})
        return spec.name, server

    with ThreadPoolExecutor(max_workers=max(1, len(specs))) as pool:
        for name, result in pool.map(one, specs):
            servers[name] = result
    return servers


def first_difference(expected: list[int], got: list[int]) -> dict[str, Any] | None:
    for i, (a, b) in enumerate(zip(expected, got, strict=False)):
        if a != b:
            return {"position": i, "expected": a, "got": b}
    if len(expected) != len(got):
        return {"position": min(len(expected), len(got)), "expected_len": len(expected), "got_len": len(got)}
    return None


def _answers(server: GpuServer, batch: int) -> tuple[list[dict[str, Any]], float]:
    t0 = time.monotonic()
    if batch == 1:
        docs = [server.generate(p, NEW_TOKENS) for p in PROMPTS]
    else:
        docs = server.generate(list(PROMPTS), NEW_TOKENS)
    return docs, time.monotonic() - t0


def compare(
    name: str, pair: str, server: GpuServer, reference: dict[int, list[list[int]]]
) -> list[dict[str, Any]]:
    records = []
    for batch in (1, len(PROMPTS)):
        before = server.graph_replays()
        docs, seconds = _answers(server, batch)
        replays = server.graph_replays() - before
        verify = sum(int(d["meta_info"].get("spec_verify_ct", 0) or 0) for d in docs)
        tokens = sum(int(d["meta_info"]["completion_tokens"]) for d in docs)
        diffs = [
            first_difference(ref, d["output_ids"]) for ref, d in zip(reference[batch], docs, strict=True)
        ]
        records.append({
            "case": "evidence", "pair": pair, "server": name, "batch": batch,
            "identical": sum(d is None for d in diffs), "prompts": len(PROMPTS),
            "first_difference": next(({"prompt": i, **d} for i, d in enumerate(diffs) if d), None),
            "differences": [{"prompt": i, **d} for i, d in enumerate(diffs) if d],
            "verify_steps": verify, "target_verify_graph_replays": replays,
            "accept_length": round(tokens / verify, 3) if verify else None,
            "tokens": tokens, "seconds": round(seconds, 3),
        })  # fmt: skip
    return records


NO_OVERLAP = ["--disable-overlap-schedule"]


def no_overlap() -> bool:
    """``DDTREE_GPU_LAB_NO_OVERLAP=1``: also this plugin with SGLang's overlap scheduler off."""
    return os.environ.get("DDTREE_GPU_LAB_NO_OVERLAP") == "1"


def baseline_env() -> dict[str, str] | None:
    """The environment of a ``-baseline`` server: the packed plugin first on PYTHONPATH."""
    baseline = os.environ.get("DDTREE_GPU_LAB_BASELINE")
    if not baseline:
        return None
    return {"PYTHONPATH": os.pathsep.join(p for p in (baseline, os.environ.get("PYTHONPATH")) if p)}


def evidence_specs() -> list[Spec]:
    specs = []
    base = baseline_env()
    for pair in _pairs():
        specs.append(Spec(f"{pair}-ddtree", pair, "DDTREE"))
        specs.append(Spec(f"{pair}-dflash", pair, "DFLASH"))
        if base:
            specs.append(Spec(f"{pair}-ddtree-baseline", pair, "DDTREE", env=base))
        if no_overlap():
            specs.append(Spec(f"{pair}-ddtree-nooverlap", pair, "DDTREE", extra=NO_OVERLAP))
    return specs


def run_evidence(models: Path, log_dir: Path, probe: bool) -> None:
    plain = start_all([Spec(f"{pair}-plain", pair) for pair in _pairs()], models, log_dir)
    others = start_all(evidence_specs(), models, log_dir)
    servers = {**plain, **others}
    try:
        for pair in _pairs():
            ref_server = servers.get(f"{pair}-plain")
            if not isinstance(ref_server, GpuServer):
                emit({"case": "evidence", "pair": pair, "error": "the plain server did not start"})
                continue
            reference = {b: [d["output_ids"] for d in _answers(ref_server, b)[0]] for b in (1, len(PROMPTS))}
            for name, server in servers.items():
                if name.startswith(f"{pair}-") and name != f"{pair}-plain" and isinstance(server, GpuServer):
                    try:
                        for record in compare(name, pair, server, reference):
                            emit(record)
                    except RuntimeError as exc:
                        emit({"case": "evidence", "pair": pair, "server": name, "error": str(exc)[-1500:]})
        if probe:
            for name, server in servers.items():
                if isinstance(server, GpuServer) and name.endswith("-ddtree"):
                    run_probe(name, server)
    finally:
        for server in servers.values():
            if isinstance(server, GpuServer):
                server.stop()


def run_probe(name: str, server: GpuServer) -> None:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "ddtree_runtime", "probe", "live", "--url", server.url, "--json"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    try:
        report: Any = json.loads(proc.stdout)
    except ValueError:
        report = {"stdout": proc.stdout[-1500:], "stderr": proc.stderr[-1500:]}
    emit({"case": "probe", "server": name, "rc": proc.returncode, "seconds": round(time.monotonic() - t0, 2),
          "report": report})  # fmt: skip


BENCH_LEVELS = (1, 4, 16)
BENCH_BUDGETS = (16, 32, 64)


def _levels() -> tuple[int, ...]:
    return tuple(int(x) for x in os.environ.get("DDTREE_GPU_LAB_LEVELS", "").split()) or BENCH_LEVELS


def _pairs() -> tuple[str, ...]:
    return tuple(os.environ.get("DDTREE_GPU_LAB_PAIRS", "dense hybrid").split())


def bench_specs() -> list[Spec]:
    idle = ["--sleep-on-idle"]
    specs = []
    # A word is a budget, ``auto`` or a comma list of widths (an adaptive server: docs/adaptive-width.md).
    words = os.environ.get("DDTREE_GPU_LAB_BUDGETS", "").split()
    budgets = tuple(int(b) if b.isdigit() else b for b in words) or BENCH_BUDGETS
    for pair in _pairs():
        specs += [Spec(f"{pair}-plain", pair, extra=idle), Spec(f"{pair}-dflash", pair, "DFLASH", extra=idle)]
        for budget in budgets:
            over = {"speculative-ddtree-budget": budget}
            # An adaptive server's narrower widths on their own verify graphs unless
            # DDTREE_GPU_LAB_WIDTH_GRAPHS=0 (sglang_plugin/round/width_runners.py).
            own = {} if isinstance(budget, int) else {
                "SGLANG_DDTREE_WIDTH_GRAPHS": os.environ.get("DDTREE_GPU_LAB_WIDTH_GRAPHS", "1")}  # fmt: skip
            name = f"{pair}-ddtree-b{budget}"
            specs.append(Spec(name, pair, "DDTREE", env=own, overrides=over, extra=idle))
            base = baseline_env()
            if base:  # the packed plugin (pack.py --baseline REF), measured in the same call
                name = f"{pair}-ddtree-b{budget}-baseline"
                specs.append(Spec(name, pair, "DDTREE", env=base, overrides=over, extra=idle))
            if no_overlap():
                name = f"{pair}-ddtree-b{budget}-nooverlap"
                specs.append(Spec(name, pair, "DDTREE", overrides=over, extra=idle + NO_OVERLAP))
    return specs


def run_bench(
    models: Path, log_dir: Path, repeats: int = int(os.environ.get("DDTREE_GPU_LAB_REPEATS", "3"))
) -> None:
    from ddtree_runtime.health.server_bench import bench_server

    servers = start_all(bench_specs(), models, log_dir)
    try:
        for pair in _pairs():
            results: dict[str, dict[int, dict[str, Any]]] = {}
            for name, server in servers.items():
                if not name.startswith(f"{pair}-") or not isinstance(server, GpuServer):
                    continue
                try:
                    results[name] = bench_server(
                        server.url, PROMPTS, levels=_levels(), repeats=repeats, label=name,
                        emit=lambda line: print(line, flush=True),
                    )  # fmt: skip
                except RuntimeError as exc:
                    emit({"case": "bench", "server": name, "error": str(exc)[-1500:]})
                else:
                    bench_phases_of(pair, name, server, repeats)
                    emit_widths(pair, name, server)
            ids = {
                name: {lvl: row.pop("ids") for lvl, row in levels.items()} for name, levels in results.items()
            }
            plain, dflash = ids.get(f"{pair}-plain"), results.get(f"{pair}-dflash")
            for name, levels in results.items():
                for level, row in levels.items():
                    same = None
                    if plain is not None and name != f"{pair}-plain":
                        same = sum(a == b for a, b in zip(plain[level], ids[name][level], strict=False))
                    ratio = None
                    if dflash is not None and dflash[level]["output_tokens_per_s"]:
                        ratio = round(row["output_tokens_per_s"] / dflash[level]["output_tokens_per_s"], 3)
                    emit({"case": "bench_summary", "pair": pair, "server": name, "concurrency": level,
                          "identical_to_plain": same, "vs_dflash": ratio, **row})  # fmt: skip
    finally:
        for server in servers.values():
            if isinstance(server, GpuServer):
                server.stop()


def bench_phases_of(pair: str, name: str, server: GpuServer, repeats: int) -> None:
    """With ``DDTREE_GPU_LAB_PHASES`` (``1 16 4 1``): a load whose concurrency changes inside one run, after
    the levels (``bench_phases`` summary line, ``health/server_bench.bench_phases``)."""
    from ddtree_runtime.health.server_bench import bench_phases

    phases = [int(x) for x in os.environ.get("DDTREE_GPU_LAB_PHASES", "").split()]
    if not phases:
        return
    try:
        out = bench_phases(server.url, PROMPTS, phases=phases, repeats=repeats, label=name,
                           emit=lambda line: print(line, flush=True))  # fmt: skip
    except RuntimeError as exc:
        emit({"case": "bench_phases", "pair": pair, "server": name, "error": str(exc)[-1500:]})
        return
    out.pop("ids")
    emit({"case": "bench_phases", "pair": pair, "server": name, **out})


def emit_widths(pair: str, name: str, server: GpuServer) -> None:
    """An adaptive server's width choice and prices after its levels (``bench_widths``: what
    scripts/bench/adaptive_width_figures.py compares with the fixed servers); nothing for one width."""
    status, info = server.request("/server_info")
    if status != 200 or not isinstance(info, dict) or "speculative_ddtree_widths" not in info:
        return
    for state in info.get("internal_states") or []:
        if isinstance(state, dict) and "ddtree_widths" in state:
            emit({"case": "bench_widths", "pair": pair, "server": name, **state["ddtree_widths"],
                  "prices": state.get("ddtree_prices")})  # fmt: skip
            return


# --- the production shape: Qwen3.6-27B with dummy weights ------------------------------------------
PROD_DEFAULT = "dflash-fp32 ddtree16-fp32"
PROD_PROFILE_LEVELS = (1, 8)  # issue 33: where a verify's time goes at batch 1 and 8
PRICE_FLAG = "--speculative-ddtree-price-table"


def prod_spec(word: str) -> Spec:
    """``dflash-fp32``, ``ddtree16-bf16``, ``plain-fp32``: decoder (budget), then the SSM state dtype of
    the 27B hybrid shape; ``dflash-dense8b``, ``ddtree15-dense8b``: the dense Qwen3-8B shape (no SSM
    state); ``ddtree16base-fp32``: the packed baseline plugin (pack.py --baseline REF). Switches after
    the shape, in any order: ``-eager`` runs the tree round without its CUDA graphs
    (SGLANG_DDTREE_ROUND_GRAPHS=0), ``-reuse`` the GDN verify that keeps a parent's state in registers
    (SGLANG_DDTREE_GDN_REUSE_PARENT=1), ``-cf`` counterfactual scoring on 5 % of greedy rounds (its
    cost against the same word without it), ``-prices`` the start-up price table
    (``--speculative-ddtree-price-table``: the verify and the rest of a round at every captured batch size,
    emitted as a ``prod_prices`` line)."""
    decoder, _, shape = word.partition("-")
    env: dict[str, str] = {}
    overrides: dict[str, Any] = {}
    extra: list[str] = []
    shape, *switches = shape.split("-")
    for switch in switches:
        if switch == "eager":
            env["SGLANG_DDTREE_ROUND_GRAPHS"] = "0"
        elif switch == "reuse":
            env["SGLANG_DDTREE_GDN_REUSE_PARENT"] = "1"
        elif switch == "cf":
            overrides["speculative-ddtree-counterfactual-fraction"] = 0.05
        elif switch == "prices":
            extra.append(PRICE_FLAG)
        else:
            raise ValueError(f"{word!r}: unknown switch -{switch} (eager, reuse, cf or prices)")
    if decoder.endswith("base"):
        decoder = decoder[: -len("base")]
        base = baseline_env()
        if base is None:
            raise ValueError(f"{word!r}: no baseline plugin was packed (pack.py --baseline REF)")
        env = {**env, **base}
    # The lab's 0.5 leaves room for several servers; one production-shape server at a time takes the
    # profile's.
    overrides["mem-fraction-static"] = 0.88
    pair = "prod8b" if shape == "dense8b" else "prod"
    if pair == "prod":
        dtype = {"fp32": "float32", "bf16": "bfloat16"}.get(shape)
        if dtype is None:
            raise ValueError(f"{word!r}: end with -fp32 or -bf16 (the SSM state dtype) or -dense8b")
        overrides["mamba-ssm-dtype"] = dtype
    algorithm: str | None = None
    if decoder == "dflash":
        algorithm = "DFLASH"
    elif decoder.startswith("ddtree") and decoder[6:].isdigit():
        algorithm = "DDTREE"
        overrides["speculative-ddtree-budget"] = int(decoder[6:])
    elif decoder.startswith("ddtree") and (decoder[6:] == "auto" or decoder[6:].replace("x", "").isdigit()):
        algorithm = "DDTREE"  # ddtreeauto, or ddtree15x31: adaptive widths (15,31)
        overrides["speculative-ddtree-budget"] = decoder[6:].replace("x", ",")
    elif decoder != "plain":
        raise ValueError(f"{word!r}: start with plain, dflash, ddtreeB, ddtreeauto or ddtreeAxB")
    dummy = ["--load-format", "dummy"]
    return Spec(f"prod-{word}", pair, algorithm, env=env, overrides=overrides, extra=dummy + extra)


def profile_round(server: GpuServer, out: Path, level: int, steps: int = 24) -> dict[str, Any]:
    """SGLang's own profiler over ``steps`` scheduler steps of ``level`` requests in flight."""
    from ddtree_runtime.health.server_bench import run_level
    from ddtree_sglang_gpu_lab.profile_gaps import analyse

    out.mkdir(parents=True, exist_ok=True)
    # Unprofiled first: the kernels a server compiles at a new batch size would otherwise sit inside the
    # profiled rounds (the first c=8 profile of 2026-12-02 had 0.7 s of Triton compiles in one round).
    run_level(server.url, PROMPTS, concurrency=level, requests=level, max_new_tokens=NEW_TOKENS)
    status, doc = server.request("/start_profile", {
        "output_dir": str(out), "num_steps": steps, "activities": ["CPU", "GPU"], "with_stack": True,
    })  # fmt: skip
    if status != 200:
        return {"error": f"/start_profile HTTP {status}: {str(doc)[:500]}"}
    run_level(server.url, PROMPTS, concurrency=level, requests=level, max_new_tokens=NEW_TOKENS)
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        traces = sorted(out.glob("*.trace.json.gz"))
        # Written once the steps are done: wait until it stops growing (mtime is wall-clock time).
        if traces and time.time() - traces[-1].stat().st_mtime > 3:
            keep = os.environ.get("DDTREE_GPU_LAB_TRACE_OUT")  # a folder the traces are copied to
            if keep:
                Path(keep).mkdir(parents=True, exist_ok=True)
                shutil.copy2(traces[-1], Path(keep) / f"{out.name}.trace.json.gz")
            return {**analyse(traces[-1]), "trace_mib": round(traces[-1].stat().st_size / 2**20, 1)}
        time.sleep(1)
    return {"error": f"no trace in {out} after 150 s: {sorted(p.name for p in out.iterdir())}"}


def _prices(server: GpuServer) -> dict[str, Any]:
    """The server's start-up price table as /server_info shows it, or why there is none."""
    from ddtree_runtime.health.sglang_client import BadAnswer, server_prices

    status, info = server.request("/server_info")
    try:
        table = server_prices(info) if status == 200 else None
    except BadAnswer as exc:
        return {"error": str(exc)}
    if table is None:
        return {"error": f"no price table on /server_info (HTTP {status}); see the server's log"}
    return {"prices": table.to_dict()}


def run_prod(models: Path, log_dir: Path) -> None:
    """One 27B server at a time (each takes the GPU): start, bench, profile at 1 and 8, stop."""
    from ddtree_runtime.health.server_bench import bench_server
    from ddtree_sglang_gpu_lab.prod_shape import write_dense8b_pair, write_prod_pair

    write_prod_pair(models / "hybrid", models / "prod")
    write_dense8b_pair(models / "dense", models / "prod8b")
    words = os.environ.get("DDTREE_GPU_LAB_PROD", PROD_DEFAULT).split()
    # One timed repeat after each level's unmeasured warm pass (bench_server): the warm pass takes the
    # place of the cold first repeat the figures of 2026-12-02 had to drop, and the call keeps its length.
    repeats = int(os.environ.get("DDTREE_GPU_LAB_REPEATS", "1"))
    stop_at = time.monotonic() + float(os.environ.get("DDTREE_GPU_LAB_DEADLINE_S", "520"))
    for word in words:
        if stop_at - time.monotonic() < float(os.environ.get("DDTREE_GPU_LAB_MIN_LEFT_S", "200")):
            emit({"case": "prod", "server": f"prod-{word}", "skipped": "not enough time left in this call"})
            continue
        spec = prod_spec(word)
        server = start_all([spec], models, log_dir)[spec.name]
        if not isinstance(server, GpuServer):
            continue
        try:
            pool = [ln[-300:] for ln in server.log.splitlines() if "max_total_num_tokens" in ln]
            emit({"case": "prod_start", "server": spec.name, "ready_s": server.ready_seconds,
                  "pool": pool[-1:]})  # fmt: skip
            if PRICE_FLAG in spec.extra:
                emit({"case": "prod_prices", "server": spec.name, **_prices(server)})
            rows = {}
            if os.environ.get("DDTREE_GPU_LAB_PROD_BENCH", "1") == "1":
                rows = bench_server(
                    server.url, PROMPTS, levels=_levels(), repeats=repeats, label=spec.name,
                    emit=lambda line: print(line, flush=True),
                )  # fmt: skip
            for level, row in rows.items():
                row.pop("ids", None)
                emit({"case": "prod_summary", "server": spec.name, "concurrency": level, **row})
            levels = os.environ.get("DDTREE_GPU_LAB_PROFILE_LEVELS", "")  # "none": no profile
            wanted: tuple[int, ...] = ()
            if levels.strip() != "none":
                wanted = tuple(int(x) for x in levels.split()) or PROD_PROFILE_LEVELS
            for level in wanted:
                report = profile_round(server, log_dir / "profiles" / f"{spec.name}-c{level}", level)
                emit({"case": "prod_profile", "server": spec.name, "concurrency": level, **report})
        except RuntimeError as exc:
            emit({"case": "prod", "server": spec.name, "error": str(exc)[-1500:]})
        finally:
            server.stop()


CASES: dict[str, Callable[[argparse.Namespace], None]] = {
    "evidence": lambda a: run_evidence(a.models, a.logs, probe=False),
    "evidence+probe": lambda a: run_evidence(a.models, a.logs, probe=True),
    "bench": lambda a: run_bench(a.models, a.logs),
    "prod": lambda a: run_prod(a.models, a.logs),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddtree_sglang_gpu_lab.cases")
    parser.add_argument("cases", nargs="+", choices=sorted(CASES))
    parser.add_argument("--models", type=Path, required=True, help="folder with dense/ and hybrid/ lab pairs")
    parser.add_argument("--logs", type=Path, required=True, help="where each server's log goes")
    args = parser.parse_args(argv)
    for case in args.cases:
        t0 = time.monotonic()
        CASES[case](args)
        emit({"case": case, "done": True, "seconds": round(time.monotonic() - t0, 1)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
