"""The real SGLang 0.5.23 server on this CPU, launched as lab host ct131's unit launches it.

The flags are the `balanced` profile's (roles/sglang_service/vars/profiles.yml), rendered the way
templates/sglang-qwen.service.j2 renders them, then ct131's CPU flags and environment
(inventories/lab/host_vars/ct131.yml): the server a test talks to is the one the lab deploys.
One server at a time; the process harness (leased ports, readiness, stop by PID, HTTP) is the lab
base's (``ddtree_sglang_lab_base.server``), the one the GPU lab's server uses too.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import yaml
from ddtree_sglang_lab_base.server import (
    READY_LINE,
    SPECULATIVE_ONLY_FLAGS,
    ServerFailed,
    ServerProcess,
    profile_flags,
    render_flags,
)

REPO = Path(__file__).resolve().parents[2]
PROFILES = REPO / "roles/sglang_service/vars/profiles.yml"
HOST_VARS = REPO / "inventories/lab/host_vars/ct131.yml"

__all__ = ["READY_LINE", "RealServer", "ServerFailed", "cpu_argv", "cpu_env", "host_vars", "profile_argv"]


@cache
def host_vars() -> dict[str, Any]:
    return yaml.safe_load(HOST_VARS.read_text())


def profile_argv(profile: str, *, speculative: bool = True) -> list[str]:
    """The profile's flags with ct131's overrides, as the unit template renders them (true: bare flag;
    false/null: left out)."""
    flags = {**profile_flags(PROFILES, profile), **host_vars().get("sglang_service_flag_overrides", {})}
    return render_flags(flags, skip=() if speculative else SPECULATIVE_ONLY_FLAGS)


def cpu_argv() -> list[str]:
    return [part for flag in host_vars()["sglang_extra_flags"] for part in flag.split()]


def cpu_env() -> dict[str, str]:
    return {k: str(v) for k, v in host_vars()["sglang_service_engine_env"].items()}


class RealServer(ServerProcess):
    """``python -m sglang.launch_server`` with the lab's CPU layer; its log in ``log_dir``."""

    ready_timeout = 420
    stop_grace = 20

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
        spec = [] if draft is None else [
            "--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", str(draft)
        ]  # fmt: skip
        args = [
            "--model-path", str(target), *spec,
            *profile_argv(profile, speculative=draft is not None), *cpu_argv(), *(extra or []),
        ]  # fmt: skip
        # ct131's unit environment only: nothing of this process's DDTREE_/SGLANG_ settings leaks in.
        super().__init__(
            args,
            log_dir=log_dir,
            env={"PYTHONUNBUFFERED": "1", **cpu_env(), **(env or {})},
            drop_env=("DDTREE_", "SGLANG_"),
        )
