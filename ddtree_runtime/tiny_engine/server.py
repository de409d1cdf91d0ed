"""`ddtree tiny-engine serve`: the tiny engine behind SGLang's HTTP surface (docs/interfaces.md section 3).

Stdlib ThreadingHTTPServer for the endpoints (http_api.py), one scheduler thread that batches queued
requests (up to --max-running-requests) into the engine. Start-up follows SGLang: the port answers
(503) while the models load, a real warm-up generation runs, then "The server is fired up and ready
to roll!". A scheduler failure is fatal the SGLang way (faults.die_like_sglang). SIGTERM drains,
then exits 0.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import queue
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from ddtree_runtime import __version__
from ddtree_runtime.tiny_engine import faults
from ddtree_runtime.tiny_engine.http_api import TinyHTTPServer, generate_item
from ddtree_runtime.tiny_engine.jobs import Job
from ddtree_runtime.tiny_engine.server_args import (
    DEFAULT_DEVICE_MEMORY_MB,
    MemoryPlan,
    ServerArgsError,
    memory_plan,
    resolve,
)
from ddtree_runtime.tiny_engine.serving_metrics import ServingMetrics

log = logging.getLogger("ddtree.lab")
SGLANG_VERSION = "0.5.23"  # the release whose surface the lab server speaks
WARMUP_TEXT = "The capital city of France is"
DECODE_LOG_INTERVAL = 40  # decode steps between two "Decode batch" lines, as in SGLang


_NOT_SERVER_ARGS = ("command", "engine_command", "lab_command", "func", "lab_fault")


class TinyServer:
    """State shared by the HTTP handlers, the scheduler thread and the main thread."""

    def __init__(self, sargs: dict, plan: faults.FaultPlan, device: str) -> None:
        self.sargs = sargs
        self.plan = plan
        self.device = device
        self.status = "starting"  # starting | ready | draining
        # Which server answers (the canary refuses to compare a server with itself under two URLs).
        self.instance_id = uuid.uuid4().hex
        self.engine = None
        self.memory: MemoryPlan | None = None
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.running = 0
        self.inflight = 0  # generation requests between arrival and answer (see request())
        self._inflight_lock = threading.Lock()
        self.term = threading.Event()  # SIGTERM/SIGINT: stop taking requests, drain
        self.stop = threading.Event()  # the scheduler's end (after the drain)
        self.metrics = (
            ServingMetrics(sargs["served_model_name"], counterfactual=self.counterfactual)
            if sargs.get("enable_metrics")
            else None
        )
        self.last_gen_throughput = 0.0
        self._scheduler: threading.Thread | None = None
        self._decode_steps = 0
        self._logged = (0, 0)  # engine (verify_ct, accepted_sum) at the last decode log line
        self._window_start = time.monotonic()
        self._window_tokens = 0  # tokens of requests finished since the last decode log line
        self._held_tokens = 0
        self._cf_snapshot: dict | None = None  # written by the scheduler thread, read by /metrics

    # ------------------------------------------------------------------ start-up

    def start(self) -> None:
        """Load, size the pool, start the scheduler, warm up. Raises on any start-up failure."""
        from ddtree_runtime.tiny_engine.engine import TinyEngine  # torch: only when serving

        sa = self.sargs
        if self.plan.start_delay_s:
            log.info(
                "Lab fault slow_start: model loading takes %.1fs (DDTREE_LAB_START_DELAY_S)",
                self.plan.start_delay_s,
            )
            if self.term.wait(self.plan.start_delay_s):
                return
        log.info("Load weight begin. avail mem=%.2f GB", self._device_total_gb())
        t0 = time.monotonic()
        algo = sa["speculative_algorithm"] or "NONE"
        self.engine = TinyEngine(
            sa["model_path"],
            sa["speculative_draft_model_path"],
            algorithm=algo,
            budget=sa["speculative_ddtree_budget"] or 16,
            topk_cap=sa["speculative_ddtree_topk_cap"],
            device=self.device,
            fault=self.plan.engine_fault,
            seed=sa["random_seed"] or 0,
            counterfactual=self._counterfactual_candidates(),
            counterfactual_fraction=sa["speculative_ddtree_counterfactual_fraction"],
            counterfactual_slots=sa["max_running_requests"],
        )
        self.engine.on_round = self._on_round
        weights = self._weight_bytes()
        log.info(
            "Load weight end. type=Qwen3ForCausalLM, dtype=torch.float32, avail mem=%.2f GB, "
            "mem usage=%.4f GB.",
            self._device_total_gb(),
            weights / 2**30,
        )
        if self.engine.contract is not None:
            c = self.engine.contract
            log.info(
                "DFLASH draft: target_layer_ids=%s, block_size=%d, fc in_features=%d; "
                "DDTree budget=%s. (%.2fs)",
                list(c.target_layer_ids),
                c.block_size,
                c.fc_in_features,
                sa["speculative_ddtree_budget"],
                time.monotonic() - t0,
            )
        draft_layers = self.engine.draft.cfg.num_hidden_layers if self.engine.draft is not None else 0
        self.memory = memory_plan(
            mem_fraction_static=sa["mem_fraction_static"],
            context_length=sa["context_length"],
            target_config=json.loads((Path(sa["model_path"]) / "config.json").read_text()),
            draft_layers=draft_layers,
            weight_bytes=weights,
        )
        kv_gb = self.memory.max_total_num_tokens * self.memory.kv_bytes_per_token / 2**30
        log.info(
            "KV Cache is allocated. #tokens: %d, K size: %.4f GB, V size: %.4f GB",
            self.memory.max_total_num_tokens,
            kv_gb / 2,
            kv_gb / 2,
        )
        log.info(
            "max_total_num_tokens=%d, chunked_prefill_size=%s, max_prefill_tokens=16384, "
            "max_running_requests=%d, context_len=%d, available_gpu_mem=%.2f GB",
            self.memory.max_total_num_tokens,
            sa["chunked_prefill_size"],
            sa["max_running_requests"],
            sa["context_length"],
            self._device_total_gb() * (1 - sa["mem_fraction_static"]),
        )
        if self.metrics is not None:
            self.metrics.max_total_num_tokens.set(self.memory.max_total_num_tokens)
            hs = self.handshake()
            if hs is not None:
                self.metrics.expected_hidden_width.set(hs["expected_hidden_width"])
                self.metrics.budget.set(hs["budget"] or 0)
            self.metrics.spec_num_draft_tokens.set(sa["speculative_num_draft_tokens"] or 0)
        self._scheduler = threading.Thread(target=self._schedule, name="scheduler", daemon=True)
        self._scheduler.start()
        if not sa["skip_server_warmup"]:
            from ddtree_runtime.tiny_engine.engine import SamplingParams

            job = self.submit([self.engine.tokenizer.encode(WARMUP_TEXT)], [SamplingParams(max_new_tokens=8)])
            log.info(
                "End of prefill warmup with status 200, resp: %s", json.dumps(generate_item(self, job, 0))
            )
        self.status = "ready"
        log.info("The server is fired up and ready to roll!")

    def _counterfactual_candidates(self) -> list | None:
        from ddtree_runtime.core.counterfactual import parse_candidates

        sa = self.sargs
        if sa["speculative_algorithm"] is None:
            return None
        block = sa["speculative_dflash_block_size"]
        return parse_candidates(sa["speculative_ddtree_counterfactual_budgets"], block - 1)

    def counterfactual(self) -> dict | None:
        """The scorer's counters as of the last decode round (None: not scoring)."""
        return self._cf_snapshot

    def _weight_bytes(self) -> int:
        mods = [self.engine.target] + ([self.engine.draft] if self.engine.draft is not None else [])
        return sum(p.numel() * 2 for m in mods for p in m.parameters())  # bf16 on disk and on a GPU

    def _device_total_gb(self) -> float:
        return float(os.environ.get("DDTREE_LAB_DEVICE_MEMORY_MB") or DEFAULT_DEVICE_MEMORY_MB) / 1024

    # ------------------------------------------------------------------ scheduling

    def submit(self, prompts: list[list[int]], params: list, *, timeout: float | None = None,
               logprobs: list | None = None) -> Job:
        """Queue a job for the scheduler and wait for its answer (job.done is unset after a timeout)."""
        job = Job(prompts, params, logprobs)
        self.jobs.put(job)
        job.done.wait(timeout)
        return job

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Held by an HTTP handler from reading a generation request to writing its answer: the drain
        waits for these, so no answer is cut off by the exit."""
        with self._inflight_lock:
            self.inflight += 1
        try:
            yield
        finally:
            with self._inflight_lock:
                self.inflight -= 1

    def _schedule(self) -> None:
        """Continuous batching: between decode rounds, queued jobs join the running batch (whole jobs, up to
        --max-running-requests requests); finished requests leave and their jobs are answered."""
        batch = self.engine.new_batch()
        limit = self.sargs["max_running_requests"]
        backlog: collections.deque[Job] = collections.deque()
        while not self.stop.is_set():
            if not len(batch) and not backlog:
                try:
                    backlog.append(self.jobs.get(timeout=0.05))
                except queue.Empty:
                    continue
                time.sleep(0.002)  # let requests that arrived together share one prefill
            while True:
                try:
                    backlog.append(self.jobs.get_nowait())
                except queue.Empty:
                    break
            try:
                self._admit(batch, backlog, limit)
                finished = batch.step()
            except Exception as exc:  # a scheduler exception takes the whole server down, as in SGLang
                faults.die_like_sglang(exc)
                raise
            self.running = len(batch)
            for req in finished:
                self._finish(req)
            if not len(batch):
                self._log_window()  # the batch drained: one decode line for what it did
            if self.metrics is not None:
                self.metrics.num_running_reqs.set(self.running)
                self.metrics.num_queue_reqs.set(len(backlog) + self.jobs.qsize())

    def _admit(self, batch, backlog: collections.deque[Job], limit: int) -> None:
        jobs: list[Job] = []
        room = limit - len(batch)
        while backlog and (len(backlog[0].prompts) <= room or not (len(batch) or jobs)):
            job = backlog.popleft()
            room -= len(job.prompts)
            jobs.append(job)
        if not jobs:
            return
        prompts = [p for j in jobs for p in j.prompts]
        log.info(
            "Prefill batch, #new-seq: %d, #new-token: %d, #cached-token: 0, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d,",
            len(prompts), sum(map(len, prompts)), self._token_usage(batch), len(batch), len(backlog),
        )  # fmt: skip
        for job in jobs:
            job.results = [None] * len(job.prompts)
            job.remaining = len(job.prompts)
            reqs = batch.admit(job.prompts, job.params, [(job, i) for i in range(len(job.prompts))],
                               job.logprobs)
            for req in reqs:
                if req.params.max_new_tokens == 0:  # never joins the batch: answered at once
                    self._finish(req)

    def _finish(self, req) -> None:
        job, i = req.tag
        job.results[i] = req.result
        job.remaining -= 1
        self._window_tokens += req.result.completion_tokens
        if job.remaining:
            return
        if self.metrics is not None:
            m = self.metrics
            m.prompt_tokens.inc(sum(map(len, job.prompts)))
            m.generation_tokens.inc(sum(r.completion_tokens for r in job.results))
            m.num_requests.inc(len(job.results))
            m.e2e_latency.observe(time.monotonic() - job.created)
        job.done.set()

    def _on_round(self, running: int, tokens: int) -> None:
        """SGLang logs a decode line every 40 decode steps; so does the lab, inside long batches."""
        self._decode_steps += 1
        self._held_tokens = tokens
        if self.engine.counterfactual is not None:
            # Read here, in the scheduler thread, so that a scrape never sees a half-updated round.
            self._cf_snapshot = self.engine.counterfactual.snapshot()
        if self._decode_steps % DECODE_LOG_INTERVAL == 0:
            self._log_window(running)

    def _log_window(self, running: int = 0) -> None:
        """One "Decode batch" line (and the spec metrics) for the rounds since the last one."""
        stats = self.engine.stats
        verify, accepted = stats.verify_ct - self._logged[0], stats.accepted_sum - self._logged[1]
        if stats.verify_ct == self._logged[0] and not self._window_tokens:
            return
        now = time.monotonic()
        self.last_gen_throughput = self._window_tokens / max(now - self._window_start, 1e-9)
        self._logged, self._window_start, self._window_tokens = (stats.verify_ct, stats.accepted_sum), now, 0
        spec = ""
        num_draft = self.sargs["speculative_num_draft_tokens"] or 2
        if verify:
            accept_len = accepted / verify
            rate = (accept_len - 1) / max(1, num_draft - 1)
            spec = f"accept len: {accept_len:.2f}, accept rate: {rate:.2f}, "
            if self.metrics is not None:
                self.metrics.spec_verify_calls.inc(verify)
                self.metrics.spec_accept_length.set(accept_len)
                self.metrics.spec_accept_rate.set(rate)
        if self.metrics is not None:
            self.metrics.gen_throughput.set(self.last_gen_throughput)
            width = stats.observed_hidden_width
            if width is not None:
                self.metrics.observed_hidden_width.set(width)
        log.info(
            "Decode batch, #running-req: %d, #token: %d, token usage: %.2f, %scuda graph: %s, "
            "gen throughput (token/s): %.2f, #queue-req: %d,",
            running, self._held_tokens, self._held_tokens / self._capacity, spec, self._cuda_graph,
            self.last_gen_throughput, self.jobs.qsize(),
        )  # fmt: skip

    @property
    def _capacity(self) -> int:
        return self.memory.max_total_num_tokens if self.memory else 1

    @property
    def _cuda_graph(self) -> bool:
        return self.device == "cuda" and not self.sargs["disable_cuda_graph"]

    def _token_usage(self, batch) -> float:
        return sum(len(r.prompt) + len(r.output) for r in batch.requests) / self._capacity

    # ------------------------------------------------------------------ views

    def handshake(self) -> dict | None:
        engine = self.engine
        if engine is None or engine.contract is None:
            return None
        c = engine.contract
        observed = engine.stats.observed_hidden_width
        if engine.stats.hidden_missing:
            status = "missing"
        elif observed is None:
            status = "pending"
        else:
            status = "ok" if observed == c.capture_width == c.fc_in_features else "mismatch"
        return {
            "algorithm": engine.algorithm,
            "budget": engine.budget if engine.algorithm == "DDTREE" else None,
            "topk_cap": engine.topk_cap,
            "block_size": c.block_size,
            "target_hidden_size": c.target_hidden_size,
            "target_layer_ids": list(c.target_layer_ids),
            "expected_hidden_width": c.capture_width,
            "draft_fc_in_features": c.fc_in_features,
            "target_hybrid": c.hybrid,
            "observed_hidden_width": observed,
            "status": status,
        }

    def server_info(self) -> dict:
        info = {k: v for k, v in self.sargs.items() if k not in _NOT_SERVER_ARGS}
        stats = self.engine.stats if self.engine is not None else None
        state = {
            "last_gen_throughput": self.last_gen_throughput,
            "effective_max_running_requests_per_dp": self.sargs["max_running_requests"],
            "memory_usage": {
                "weight": (self._weight_bytes() / 2**30) if self.engine else 0.0,
                "kvcache": (self.memory.max_total_num_tokens * self.memory.kv_bytes_per_token / 2**30)
                if self.memory
                else 0.0,
                "token_capacity": self.memory.max_total_num_tokens if self.memory else 0,
                "graph": 0.0,
            },
        }
        if stats is not None and stats.verify_ct:
            state["avg_spec_accept_length"] = stats.accepted_sum / stats.verify_ct
        info.update(
            version=SGLANG_VERSION,
            ddtree_runtime_version=__version__,
            ddtree_instance_id=self.instance_id,
            engine="ddtree-lab",
            status=self.status,
            max_total_num_tokens=self.memory.max_total_num_tokens if self.memory else None,
            internal_states=[state],
            ddtree_handshake=self.handshake(),
        )
        return info

    def model_info(self) -> dict:
        return {
            "model_path": self.sargs["model_path"],
            "tokenizer_path": self.sargs["tokenizer_path"],
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
        }


# ---------------------------------------------------------------------------- main


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, str(level).upper(), logging.INFO),
        format="[%(asctime)s] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        force=True,
    )


def _default_device(flag: str | None) -> str:
    import torch

    # The lab models are tiny: more CPU threads only spin against each other (and against the other lab
    # hosts on the same machine). DDTREE_LAB_THREADS overrides.
    torch.set_num_threads(int(os.environ.get("DDTREE_LAB_THREADS") or 1))
    if flag:
        return flag
    return "cuda" if torch.cuda.is_available() else "cpu"


def serve(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level)
    try:
        plan = faults.fault_plan(args.lab_fault)
        target_cfg = _read_json_file(Path(args.model_path) / "config.json", "--model-path")
        draft_block = None
        if args.speculative_draft_model_path and (args.speculative_algorithm or "").upper() in (
            "DFLASH",
            "DDTREE",
        ):
            dcfg = _read_json_file(
                Path(args.speculative_draft_model_path) / "config.json", "--speculative-draft-model-path"
            )
            draft_block = (dcfg.get("dflash_config") or {}).get("block_size") or dcfg.get("block_size")
        sargs = resolve(args, target_config=target_cfg, draft_block_size=draft_block)
    except (ServerArgsError, ValueError, OSError) as exc:
        log.error("%s: %s", "ValueError" if isinstance(exc, ValueError) else type(exc).__name__, exc)
        return 1
    device = _default_device(args.device)
    sargs["device"] = device
    sargs["launch_command"] = "ddtree tiny-engine serve " + " ".join(_argv_of(args))
    shown = {k: v for k, v in sargs.items() if k not in _NOT_SERVER_ARGS}
    log.info("server_args=ServerArgs(%s)", ", ".join(f"{k}={v!r}" for k, v in shown.items()))
    if plan.fault:
        log.info("Lab fault armed: %s", plan.fault)
    lab = TinyServer(sargs, plan, device)
    try:
        httpd = TinyHTTPServer((sargs["host"], sargs["port"]), lab)
    except OSError as exc:
        log.error(
            "[Errno %s] error while attempting to bind on address (%r, %d): %s",
            exc.errno,
            sargs["host"],
            sargs["port"],
            (exc.strerror or str(exc)).lower(),
        )
        return 1
    threading.Thread(target=httpd.serve_forever, name="http", daemon=True).start()
    log.info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)", sargs["host"], sargs["port"])

    def on_term(signum, _frame) -> None:
        log.info("Received %s: draining in-flight requests, then exiting.", signal.Signals(signum).name)
        lab.term.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    try:
        lab.start()
    except Exception as exc:
        faults.die_like_sglang(exc)
    if plan.fault == "crash_after_start" and lab.status == "ready":
        faults.arm_crash_after_start(plan.crash_after_s)
    while not lab.term.wait(0.5):
        pass
    return _drain(lab, httpd)


def _drain(lab: TinyServer, httpd: TinyHTTPServer) -> int:
    lab.status = "draining"
    while lab.inflight or lab.running or not lab.jobs.empty():
        log.info("Gracefully exiting... Remaining number of requests %d.", max(lab.inflight, lab.running))
        time.sleep(0.2)
    lab.stop.set()
    httpd.shutdown()
    httpd.server_close()
    log.info("Finished server process")
    return 0


def _read_json_file(path: Path, flag: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise OSError(f"{path} not found: {flag} must name a model directory with a config.json") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc


def _argv_of(args: argparse.Namespace) -> list[str]:
    out = []
    for k, v in sorted(vars(args).items()):
        if k in _NOT_SERVER_ARGS or v in (None, False):
            continue
        out.append(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}"))
    return out
