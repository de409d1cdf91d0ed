"""Imported at every interpreter start in a venv that holds this distribution (``ddtree_sglang_cpu_lab.pth``).
Does nothing unless ``DDTREE_SGLANG_CPU_LAB=1``. A refusal (another SGLang release, an unknown fault
switch) ends the interpreter with the reason: a lab server must not start half patched."""

from __future__ import annotations

import os

from ddtree_sglang_cpu_lab import ENV_FLAG

if os.environ.get(ENV_FLAG) == "1":
    from ddtree_sglang_cpu_lab.install import Refused, install_all

    try:
        install_all()
    except Refused as exc:
        raise SystemExit(f"ddtree-sglang-cpu-lab refused to start: {exc}") from None
