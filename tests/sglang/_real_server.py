"""The real SGLang 0.5.23 server on this CPU, launched as lab host ct131's unit launches it.

The flags are the `balanced` profile's (roles/sglang_service/vars/profiles.yml), rendered the way
templates/sglang-qwen.service.j2 renders them, then ct131's CPU flags and environment
(inventories/lab/host_vars/ct131.yml): the server a test talks to is the one the lab deploys.
One server at a time; a server is stopped by its PID and its children's PIDs.
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
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from ddtree_runtime.tiny_engine.ports import lease_ports

REPO = Path(__file__).resolve().parents[2]
READY_LINE = "The server is fired up and ready to roll!"
PROFILES = REPO / "roles/sglang_service/vars/profiles.yml"
HOST_VARS = REPO / "inventories/lab/host_vars/ct131.yml"
SPECULATIVE_ONLY_FLAGS = ("speculative-ddtree-budget", "speculative-ddtree-topk-cap")


@cache
def host_vars() -> dict[str, Any]:
    return yaml.safe_load(HOST_VARS.read_text())


def profile_argv(profile: str, *, speculative: bool = True) -> list[str]:
    """The profile's flags with ct131's overrides, as the unit template renders them (true: bare flag;
    false/null: left out)."""
    flags = yaml.safe_load(PROFILES.read_text())["sglang_service_profiles"][profile]["flags"]
    flags = {**flags, **host_vars().get("sglang_service_flag_overrides", {})}
    argv: list[str] = []
    for name, value in flags.items():
        if value is None or value is False or (not speculative and name in SPECULATIVE_ONLY_FLAGS):
            continue
        argv += [f"--{name}"] if value is True else [f"--{name}", str(value)]
    return argv


def cpu_argv() -> list[str]:
    return [part for flag in host_vars()["sglang_extra_flags"] for part in flag.split()]


def cpu_env() -> dict[str, str]:
    return {k: str(v) for k, v in host_vars()["sglang_service_engine_env"].items()}


class RealServer:
    """``python -m sglang.launch_server`` with the lab's CPU layer; its log in a file."""

    def __init__(
        self,
        target: Path,
        draft: Path | None,
        *,
        log_dir: Path,
        profile: str = "balanced",
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        # Every port the server binds, held until stop(): its HTTP port and torch.distributed's
        # (--nccl-port, which SGLang would otherwise draw itself, free only until another draws it).
        self.lease = lease_ports(2)
        self.port, self.nccl_port = self.lease.ports
        self.url = f"http://127.0.0.1:{self.port}"
        spec = [] if draft is None else [
            "--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", str(draft)
        ]
        self.argv = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", str(target), *spec,
            *profile_argv(profile, speculative=draft is not None), *cpu_argv(), *(extra or []),
            "--enable-metrics", "--host", "127.0.0.1", "--port", str(self.port),
            "--nccl-port", str(self.nccl_port),
        ]  # fmt: skip
        self.log_path = log_dir / f"sglang-{self.port}.log"
        child_env = {k: v for k, v in os.environ.items() if not k.startswith(("DDTREE_", "SGLANG_"))}
        child_env.update({"PYTHONUNBUFFERED": "1", **cpu_env(), **(env or {})})
        self.started = time.monotonic()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=child_env)
        self.ready_seconds: float | None = None

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 420) -> float:
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if READY_LINE in self.log:
                self.ready_seconds = round(time.monotonic() - self.started, 1)
                return self.ready_seconds
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise AssertionError(f"SGLang exited {code} before ready:\n{self.log[-6000:]}")
            time.sleep(0.5)
        self.stop()
        raise AssertionError(f"SGLang not ready in {timeout:g} s:\n{self.log[-6000:]}")

    def wait_exit(self, timeout: float = 420) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            self.stop()
            raise AssertionError(f"SGLang still running after {timeout:g} s:\n{self.log[-6000:]}") from exc

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
                self.proc.wait(20)
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
                body = resp.read()
                status = resp.status
        except urllib.error.HTTPError as exc:
            body, status = exc.read(), exc.code
        try:
            return status, json.loads(body)
        except ValueError:
            return status, body.decode(errors="replace")

    def generate(self, text: str | list[str], max_new_tokens: int, **sampling: Any) -> Any:
        params = {"temperature": 0, "max_new_tokens": max_new_tokens, **sampling}
        status, doc = self.request("/generate", {"text": text, "sampling_params": params})
        assert status == 200, f"/generate HTTP {status}: {doc}"
        return doc

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=60) as resp:
            return resp.read().decode()

    def __enter__(self) -> RealServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
