"""The real SGLang 0.5.23 server on the device H200, launched with a profile's flags.

The flags are a profile's (``roles/sglang_service/vars/profiles.yml``, rendered as the unit template
renders them: ``true`` a bare flag, ``false``/null left out), then the GPU lab's own (``LAB_FLAGS``),
then the case's. CUDA graphs stay on (SGLang's default) and the attention backend is Triton, the one
DDTREE allows for trees. Several servers share the one GPU, each on its own ports; each is stopped by
its PID and its children's PIDs. The process harness (leased ports, readiness, stop by PID, HTTP) is the
lab base's (``ddtree_sglang_lab_base.server``), the one the CPU suites use too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ddtree_sglang_lab_base.server import (
    READY_LINE,
    SPECULATIVE_ONLY_FLAGS,
    ServerFailed,
    ServerProcess,
    profile_flags,
    render_flags,
)

# Hybrid-only flags SGLang refuses for a dense target (as lab host ct131 drops them).
HYBRID_ONLY_FLAGS = ("mamba-radix-cache-strategy", "mamba-ssm-dtype", "max-mamba-cache-size")
# What the GPU lab adds after a profile's flags, and why:
LAB_FLAGS = (
    "--attention-backend", "triton",  # DDTREE's tree-capable backend (sglang_plugin.refusals.resolution)
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
    profiles = repo_root() / "roles/sglang_service/vars/profiles.yml"
    flags = {**profile_flags(profiles, profile), **LAB_OVERRIDES, **(overrides or {})}
    skip = (() if speculative else SPECULATIVE_ONLY_FLAGS) + (() if hybrid else HYBRID_ONLY_FLAGS)
    return render_flags(flags, skip=skip)


class GpuServer(ServerProcess):
    """``python -m sglang.launch_server`` for one case; its log in ``log_dir/<name>.log``."""

    ready_timeout = 480
    stop_grace = 30

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
        spec: list[str] = []
        if algorithm is not None:
            spec = ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", str(draft)]
        speculative_flags = algorithm == "DDTREE"
        args = [
            "--model-path", str(target), *spec,
            *profile_argv(profile, speculative=speculative_flags, hybrid=hybrid, overrides=overrides),
            *LAB_FLAGS, *(extra or []),
        ]  # fmt: skip
        # cwd is the log folder: `python -m` puts cwd first on sys.path, and the checkout's own
        # ddtree_runtime there would shadow a baseline plugin put first on PYTHONPATH.
        super().__init__(
            args,
            log_dir=log_dir,
            env={**LAB_ENV, **(env or {})},
            drop_env=("DDTREE_LAB_FAULT", "SGLANG_LOG"),
            name=name,
            cwd=log_dir,
        )

    def graph_replays(self, mode: str = "TARGET_VERIFY", worker: str = "target") -> int:
        """Lines SGLang logs per graph replay with SGLANG_LOG_DECODE_GRAPH_KEY=1."""
        needle = f"Decode graph replay: worker={worker} "
        return sum(1 for line in self.log.splitlines() if needle in line and f"mode={mode}" in line)


__all__ = [
    "HYBRID_ONLY_FLAGS", "LAB_ENV", "LAB_FLAGS", "LAB_OVERRIDES", "READY_LINE", "SPECULATIVE_ONLY_FLAGS",
    "GpuServer", "ServerFailed", "profile_argv", "repo_root",
]  # fmt: skip
