"""The real SGLang server as a process: the one harness of the CPU suites (``tests/sglang/_real_server.py``)
and the GPU lab (``ddtree_sglang_gpu_lab.server``, its suite and its ``cases``); the unit tests' tiny-engine
server (``tests/unit/_tiny_server.py``) is the same harness with another command.

``python -m sglang.launch_server`` with the caller's flags, on two leased ports (``--port`` and
``--nccl-port``, held until the server is stopped: SGLang's own draw of the distributed-init port let
two of seven servers started at once collide), its output in a log file. ``wait_ready`` waits for
SGLang's ready line and fails with the log's tail when the process exits or the time runs out; ``stop``
ends the launcher and every child it had, each by PID. HTTP goes through the health tools' one client
(``ddtree_runtime.health.sglang_client``). Each caller builds the flags and the environment (a lab
host's unit, the GPU lab's); this renders a profile's flags the way the unit template does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Container, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from ddtree_runtime.health import http_client, sglang_client
from ddtree_runtime.tiny_engine.ports import lease_ports

READY_LINE = "The server is fired up and ready to roll!"
# A profile's flags that SGLang refuses without a speculative algorithm.
SPECULATIVE_ONLY_FLAGS = ("speculative-ddtree-budget", "speculative-ddtree-topk-cap")
LOG_TAIL = 6000  # characters of the log a failure shows


class ServerFailed(RuntimeError):
    """The server did not start, did not stop, or answered an error: the message carries the log's tail."""


def render_flags(flags: Mapping[str, Any], *, skip: Container[str] = ()) -> list[str]:
    """A profile's flags as ``templates/sglang-qwen.service.j2`` renders them: ``true`` a bare flag,
    ``false``/null left out; names in ``skip`` left out."""
    argv: list[str] = []
    for name, value in flags.items():
        if value is None or value is False or name in skip:
            continue
        argv += [f"--{name}"] if value is True else [f"--{name}", str(value)]
    return argv


def profile_flags(profiles: Path, profile: str) -> dict[str, Any]:
    """The flags of ``profile`` in ``roles/sglang_service/vars/profiles.yml``."""
    import yaml  # the GPU lab's device has it from its wheels; imported only where a profile is read

    return dict(yaml.safe_load(profiles.read_text())["sglang_service_profiles"][profile]["flags"])


class ServerProcess:
    """One ``python -m sglang.launch_server``; its log in ``log_dir/<name>.log`` (``sglang-<port>`` when
    no name is given). A subclass may start another server that prints SGLang's ready line (``command``,
    ``ports``)."""

    ready_timeout: float = 420  # seconds from start to SGLang's ready line
    stop_grace: float = 20  # seconds the launcher has after SIGTERM before SIGKILL
    ports: int = 2  # leased: the HTTP port, then SGLang's torch.distributed port
    poll_s: float = 0.5  # between two looks at the log while waiting
    name_prefix: str = "sglang"
    what: str = "SGLang"  # the server's name in a failure

    def __init__(
        self,
        args: Sequence[str],
        *,
        log_dir: Path,
        env: Mapping[str, str],
        drop_env: tuple[str, ...] = (),
        name: str | None = None,
        cwd: Path | None = None,
    ) -> None:
        """``args`` after ``-m sglang.launch_server`` (the harness adds the metrics, host and ports);
        the child's environment is this process's without the variables starting with one of
        ``drop_env``, then ``env``."""
        self.lease = lease_ports(self.ports)
        self.port, *self.extra_ports = self.lease.ports
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name or f"{self.name_prefix}-{self.port}"
        self.argv = self.command(args)
        self.log_path = log_dir / f"{self.name}.log"
        child_env = {k: v for k, v in os.environ.items() if not k.startswith(drop_env)}
        child_env.update(env)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self.ready_seconds: float | None = None
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, env=child_env, cwd=cwd
            )

    def command(self, args: Sequence[str]) -> list[str]:
        """The child's argv: ``args`` after ``-m sglang.launch_server``, then the metrics, host and ports."""
        return [
            sys.executable, "-m", "sglang.launch_server", *args,
            "--enable-metrics", "--host", "127.0.0.1", "--port", str(self.port),
            "--nccl-port", str(self.nccl_port),
        ]  # fmt: skip

    @property
    def nccl_port(self) -> int:
        """SGLang's torch.distributed port (``--nccl-port``), leased with the HTTP port."""
        return self.extra_ports[0]

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _failed(self, what: str) -> ServerFailed:
        return ServerFailed(f"{self.name}: {self.what} {what}:\n{self.log[-LOG_TAIL:]}")

    def wait_ready(self, timeout: float | None = None) -> float:
        """Seconds from start to ready; ServerFailed with the log's tail when the server exits first or
        is not ready in ``timeout`` (then it is stopped)."""
        timeout = self.ready_timeout if timeout is None else timeout
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if READY_LINE in self.log:
                self.ready_seconds = round(time.monotonic() - self.started, 1)
                return self.ready_seconds
            if self.proc.poll() is not None:
                raise self._failed(f"exited {self.proc.returncode} before ready")
            time.sleep(self.poll_s)
        self.stop()
        raise self._failed(f"not ready in {timeout:g} s")

    def wait_exit(self, timeout: float | None = None) -> int:
        """The exit status of a server expected to end by itself (it is stopped when it does not)."""
        timeout = self.ready_timeout if timeout is None else timeout
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise self._failed(f"still running after {timeout:g} s") from None

    def stop(self) -> None:
        """SIGTERM the launcher, then SIGKILL it and every child it had, each by PID; release the ports."""
        import psutil

        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        psutil.wait_procs(children, timeout=10)
        self.lease.release()

    # --- HTTP, through the health tools' client -------------------------------------------------------
    def request(self, path: str, payload: Any = None, *, timeout: float = 300) -> tuple[int, Any]:
        """(status, the answer as JSON, else as text) of a GET, or a POST of ``payload``; HTTP error
        statuses are returned, no answer raises ``http_client.HTTPFailure``."""
        status, body = http_client.request(self.url + path, payload=payload, timeout=timeout)
        doc = sglang_client.read_json(body)
        return status, body.decode(errors="replace") if doc is None else doc

    def generate(self, text: str | list[str], max_new_tokens: int, **sampling: Any) -> Any:
        """Greedy unless ``sampling`` says otherwise; the answer (a list for a list of texts)."""
        params = {"temperature": 0, "max_new_tokens": max_new_tokens, **sampling}
        payload = {"text": text, "sampling_params": params}
        status, body = sglang_client.generate(self.url, payload, timeout=300)
        doc = sglang_client.read_json(body)
        if status != 200 or doc is None:
            shown = body[:2000].decode(errors="replace")
            raise ServerFailed(f"{self.name}: /generate HTTP {status}: {shown}")
        return doc

    def metrics(self) -> str:
        status, body = sglang_client.metrics(self.url, timeout=60)
        if status != 200:
            raise ServerFailed(f"{self.name}: /metrics HTTP {status}")
        return body.decode()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
