"""Lab only: what lets the unmodified SGLang 0.5.23 wheel's Python files serve on the device H200.

The device (the workplace's H200, reached through the `device` tool) has torch 2.11, Triton 3.6 and
nvcc, but no network and no SGLang: SGLang's Python files travel from the pinned wheel, and the two
CUDA packages a GPU host installs beside it (``sgl-kernel`` and ``flashinfer-python``, 60+ MB of
compiled kernels) do not. Each piece here stands in for one thing those packages provide, says which,
and is checked against a plain reference on the GPU where it decides what attention, normalisation or
sampling computes (``tests/gpu/test_gpu_lab_layer.py``).

Never on a production host: it is its own distribution (``ddtree-sglang-gpu-lab``, built from
``scripts/lab/sglang-gpu-lab/``), only the GPU lab's device set-up installs it
(``scripts/lab/gpu/device.sh``), and it does nothing unless the process runs with
``DDTREE_SGLANG_GPU_LAB=1``. Loaded at interpreter start by ``ddtree_sglang_gpu_lab.pth`` in every
SGLang process; it refuses to start on another SGLang release or when a seam it relies on moved
(``seams.py``; ``tests/sglang/test_gpu_lab_layer.py`` checks them on CPU). ``docs/sglang-gpu-lab.md``
describes each piece. The machinery it shares with the CPU layer (boot, install, seams, fault switch,
``sgl_kernel`` stand-in, the server harness) is ``ddtree_sglang_lab_base``, a distribution of its own
(``scripts/lab/sglang-lab-base/``), which the GPU lab installs beside this one.
"""

from __future__ import annotations

from ddtree_sglang_lab_base import PINNED_SGLANG_VERSION

ENV_FLAG = "DDTREE_SGLANG_GPU_LAB"
DISTRIBUTION = "ddtree-sglang-gpu-lab"

__all__ = ["DISTRIBUTION", "ENV_FLAG", "PINNED_SGLANG_VERSION"]
