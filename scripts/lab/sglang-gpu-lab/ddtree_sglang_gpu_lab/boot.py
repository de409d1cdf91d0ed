"""Imported at every interpreter start in an environment that holds this distribution
(``ddtree_sglang_gpu_lab.pth``). Does nothing unless ``DDTREE_SGLANG_GPU_LAB=1``. A refusal ends the
interpreter with the reason: a lab server must not start half patched."""

from __future__ import annotations

import os

from ddtree_sglang_gpu_lab import ENV_FLAG

if os.environ.get(ENV_FLAG) == "1":
    from ddtree_sglang_gpu_lab.install import Refused, install_all

    try:
        install_all()
    except Refused as exc:
        raise SystemExit(f"ddtree-sglang-gpu-lab refused to start: {exc}") from None
