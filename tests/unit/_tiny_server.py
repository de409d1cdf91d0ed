"""`ddtree tiny-engine serve ...` as a child process, on the lab base's process harness (the one the real
SGLang servers of the CPU suites and the GPU lab run on): a leased port held until ``stop``, its log in a
file, ``wait_ready`` / ``wait_exit`` failing with the log's tail, ``stop`` by PID."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from ddtree_sglang_lab_base.server import ServerProcess


class TinyServerProcess(ServerProcess):
    """The tiny engine's server with ``args`` (SGLang's launch flags; the harness adds ``--port``); its log
    in ``tmp``. Its environment is this process's without the ``DDTREE_LAB_*`` switches, then ``env``."""

    ready_timeout = 60
    stop_grace = 15
    ports = 1
    poll_s = 0.1  # it is ready in a second or two
    name_prefix = "serve"
    what = "the tiny engine's server"

    def __init__(self, args: Sequence[str], *, env: dict[str, str] | None = None, tmp: Path) -> None:
        super().__init__(args, log_dir=tmp, drop_env=("DDTREE_LAB_",),
                         env={"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})})  # fmt: skip

    def command(self, args: Sequence[str]) -> list[str]:
        return [sys.executable, "-m", "ddtree_runtime", "tiny-engine", "serve", *args,
                "--port", str(self.port)]  # fmt: skip
