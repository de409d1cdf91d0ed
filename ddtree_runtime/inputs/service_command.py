"""What the service unit is made of: its ExecStart words and its env file's pairs (rendered by
templates/sglang-qwen.service.j2 and sglang-qwen.env.j2 through the ddtree_service_* filters)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .launch_flags import flag_words, split_launch_flags
from .values import as_bool


def service_argv(v: Mapping[str, Any]) -> list[str]:
    """The unit's ExecStart words: the engine, the models, the profile's flags, the host's, the address."""
    release = v["release_dir"]
    head = ([f"{release}/bin/ddtree", "tiny-engine", "serve"] if v["engine"] == "lab"
            else [f"{release}/bin/python", "-m", "sglang.launch_server"])
    argv = [*head, "--model-path", v["model_path"], "--speculative-algorithm", v["speculative_algorithm"],
            "--speculative-draft-model-path", v["draft_model_path"]]
    argv += flag_words(v["profile_data"]["flags"])
    argv += split_launch_flags(v.get("extra_flags") or [], "sglang_service_extra_flags")
    if as_bool(v["enable_metrics"]):
        argv.append("--enable-metrics")
    return [*argv, "--host", str(v["host"]), "--port", str(v["effective_port"])]


def service_env(v: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The env file's NAME=value pairs, in the file's order (later names win in systemd too)."""
    pairs: list[tuple[str, str]] = []
    if str(v.get("cuda_visible_devices") or "") != "":
        pairs.append(("CUDA_VISIBLE_DEVICES", str(v["cuda_visible_devices"])))
    extra = v.get("extra_env") or {}
    pairs += [(k, str(x)) for k, x in sorted((v.get("engine_env") or {}).items()) if k not in extra]
    pairs += [(k, str(x)) for k, x in sorted(extra.items())]
    pairs += [(k, str(x)) for k, x in sorted((v.get("secret_env") or {}).items())]
    return pairs
