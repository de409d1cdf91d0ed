"""Lab only: what lets the unmodified SGLang 0.5.23 wheel serve the lab models on a CPU-only lab host.

Never on a GPU host, never in a production release. It is its own distribution
(``ddtree-sglang-cpu-lab``, built from ``scripts/lab/sglang-cpu-lab/``), installed into a release venv
only when the lab inventory asks for it (``ddtree_runtime_lab_cpu_compat``), and it does nothing unless
the process runs with ``DDTREE_SGLANG_CPU_LAB=1`` (the lab inventory puts that in the unit's env file).

Loaded at interpreter start by ``ddtree_sglang_cpu_lab.pth`` (SGLang's scheduler, detokenizer and
tokenizer processes are fresh interpreters: each loads it the same way). Every piece names the SGLang
limitation it works around and the SGLang function it relies on (``seams.SEAMS``); the boot refuses to
start when the installed SGLang is not the release those functions were read from, or when one of them
changed (``seams.check_version``, ``seams.require``). ``docs/sglang-cpu-lab.md`` describes each piece.
The machinery it shares with the GPU lab's layer (boot, install, seams, fault switch, ``sgl_kernel``
stand-in, the server harness) is ``ddtree_sglang_lab_base``.
"""

from __future__ import annotations

from ddtree_sglang_lab_base import PINNED_SGLANG_VERSION

ENV_FLAG = "DDTREE_SGLANG_CPU_LAB"
DISTRIBUTION = "ddtree-sglang-cpu-lab"

__all__ = ["DISTRIBUTION", "ENV_FLAG", "PINNED_SGLANG_VERSION"]
