"""The real SGLang 0.5.23 server on the device H200, launched with a profile's flags.

The flags are a profile's (``roles/sglang_service/vars/profiles.yml``, rendered as the unit template
renders them: ``true`` a bare flag, ``false``/null left out), then the GPU lab's own (``LAB_FLAGS``),
then the case's. CUDA graphs stay on (SGLang's default) and the attention backend is Triton, the one
DDTREE allows for trees. Several servers share the one GPU, each on its own port; each is stopped by
its PID and its children's PIDs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ddtree_runtime.tiny_engine.ports import lease_ports

READY_LINE = "The server is fired up and ready to roll!"
SPECULATIVE_ONLY_FLAGS = ("speculative-ddtree-budget", "speculative-ddtree-topk-cap")
# Hybrid-only flags SGLang refuses for a dense target (as lab host ct131 drops them).
HYBRID_ONLY_FLAGS = ("mamba-radix-cache-strategy", "mamba-ssm-dtype", "max-mamba-cache-size")
# What the GPU lab adds after a profile's flags, and why:
LAB_FLAGS = (
    "--attention-backend", "triton",  # DDTREE's tree-capable backend (gates.TREE_MASK_ATTENTION_BACKENDS)
    "--sampling-backend", "pytorch",  # flashinfer's samplers are not on the device
    # Tiny models: without a cap SGLang sizes the KV pool from the free memory (125 GB).
    "--max-total-tokens", "65536",
    # The breakable prefill graphs take 36 s of a start; decode and target-verify graphs (what this
    # lab is about) stay on.
    "--cuda-graph-backend-prefill", "disabled",
)  # fmt: skip
# Several servers share the GPU: each one's static budget leaves room for the others' pools and graphs.
LAB_OVERRIDES = {"mem-fraction-static": 0.5}
LAB_ENV = {
    "DDTREE_SGLANG_GPU_LAB": "1",
    "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",  # the sgl_kernel stand-in has no version to match
    "SGLANG_IS_FLASHINFER_AVAILABLE": "false",
    "PYTHONUNBUFFERED": "1",
    # NVLink multicast off in every process (the device README: it can take shared GPUs down).
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def repo_root() -> Path:
    env = os.environ.get("DDTREE_REPO")
    if env:
        return Path(env)
    for candidate in (Path.cwd(), *Path.cwd().parents):
        if (candidate / "roles/sglang_service/vars/profiles.yml").is_file():
            return candidate
    raise FileNotFoundError(
        "run from the project checkout (roles/sglang_service/vars/profiles.yml) or set DDTREE_REPO"
    )


def profile_argv(
    profile: str, *, speculative: bool, hybrid: bool, overrides: dict[str, Any] | None = None
) -> list[str]:
    import yaml

    doc = yaml.safe_load((repo_root() / "roles/sglang_service/vars/profiles.yml").read_text())
    flags = {**doc["sglang_service_profiles"][profile]["flags"], **LAB_OVERRIDES, **(overrides or {})}
    argv: list[str] = []
    for name, value in flags.items():
        if value is None or value is False:
            continue
        if not speculative and name in SPECULATIVE_ONLY_FLAGS:
            continue
        if not hybrid and name in HYBRID_ONLY_FLAGS:
            continue
        argv += [f"--{name}"] if value is True else [f"--{name}", str(value)]
    return argv


class GpuServer:
    """``python -m sglang.launch_server`` for one case; its log in ``log_dir``."""

    def __init__(
        self,
        name: str,
        target: Path,
        *,
        log_dir: Path,
        algorithm: str | None = None,
        draft: Path | None = None,
        hybrid: bool = False,
        profile: str = "balanced",
        overrides: dict[str, Any] | None = None,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        # Every port the server binds, held until stop(): servers start side by side (start_all), and
        # SGLang's own draw of --nccl-port (torch.distributed's store) let two of seven collide.
        self.lease = lease_ports(2)
        self.port, self.nccl_port = self.lease.ports
        self.url = f"http://127.0.0.1:{self.port}"
        spec: list[str] = []
        if algorithm is not None:
            spec = ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", str(draft)]
        speculative_flags = algorithm == "DDTREE"
        self.argv = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", str(target), *spec,
            *profile_argv(profile, speculative=speculative_flags, hybrid=hybrid, overrides=overrides),
            *LAB_FLAGS, *(extra or []),
            "--enable-metrics", "--host", "127.0.0.1", "--port", str(self.port),
            "--nccl-port", str(self.nccl_port),
        ]  # fmt: skip
        self.log_path = log_dir / f"{name}.log"
        child_env = {
            k: v for k, v in os.environ.items() if not k.startswith(("DDTREE_LAB_FAULT", "SGLANG_LOG"))
        }
        child_env.update({**LAB_ENV, **(env or {})})
        self.started = time.monotonic()
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            # cwd is the log folder: `python -m` puts cwd first on sys.path, and the checkout's own
            # ddtree_runtime there would shadow a baseline plugin put first on PYTHONPATH.
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, env=child_env, cwd=log_dir
            )
        self.ready_seconds: float | None = None

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 480) -> float:
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if READY_LINE in self.log:
                self.ready_seconds = round(time.monotonic() - self.started, 1)
                return self.ready_seconds
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name}: SGLang exited {self.proc.returncode} before ready:\n{self.log[-5000:]}"
                )
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name}: SGLang not ready in {timeout:g} s:\n{self.log[-5000:]}")

    def stop(self) -> None:
        """SIGTERM the launcher, then SIGKILL it and every child it had, each by PID."""
        import psutil

        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        psutil.wait_procs(children, timeout=10)
        self.lease.release()

    # --- HTTP ----------------------------------------------------------------------------------
    def request(self, path: str, payload: Any = None, *, timeout: float = 300) -> tuple[int, Any]:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                body, status = resp.read(), resp.status
        except urllib.error.HTTPError as exc:
            body, status = exc.read(), exc.code
        try:
            return status, json.loads(body)
        except ValueError:
            return status, body.decode(errors="replace")

    def generate(self, text: str | list[str], max_new_tokens: int, **sampling: Any) -> Any:
        params = {"temperature": 0, "max_new_tokens": max_new_tokens, **sampling}
        status, doc = self.request("/generate", {"text": text, "sampling_params": params})
        if status != 200:
            raise RuntimeError(f"{self.name}: /generate HTTP {status}: {str(doc)[:2000]}")
        return doc

    def graph_replays(self, mode: str = "TARGET_VERIFY", worker: str = "target") -> int:
        """Lines SGLang logs per graph replay with SGLANG_LOG_DECODE_GRAPH_KEY=1."""
        needle = f"Decode graph replay: worker={worker} "
        return sum(1 for line in self.log.splitlines() if needle in line and f"mode={mode}" in line)

    def __enter__(self) -> GpuServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
