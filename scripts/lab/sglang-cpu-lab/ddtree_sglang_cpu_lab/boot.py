"""Imported at every interpreter start in a venv that holds this distribution (``ddtree_sglang_cpu_lab.pth``).
Does nothing unless ``DDTREE_SGLANG_CPU_LAB=1``. A refusal (another SGLang release, an unknown fault
switch) ends the interpreter with the reason: a lab server must not start half patched."""

from __future__ import annotations

from ddtree_sglang_lab_base.layer import boot

from ddtree_sglang_cpu_lab import DISTRIBUTION, ENV_FLAG

boot(DISTRIBUTION, ENV_FLAG, "ddtree_sglang_cpu_lab")
