"""Lab only: the machinery the two lab layers share (the CPU layer, ``ddtree_sglang_cpu_lab``, and the GPU
lab's, ``ddtree_sglang_gpu_lab``), kept in one place so the two cannot drift apart.

* ``layer``: the boot at interpreter start (nothing unless the layer's switch is on), the install of a
  layer's pieces in order, the refusal, the ``DDTREE_LAB_FAULT`` switch;
* ``seams``: SGLang code pinned by content (a source digest per function a work-around relies on);
* ``hooks``: run a patch when SGLang first imports the module it patches;
* ``standin``: a stand-in for a compiled kernel package (``sgl_kernel``) whose unimplemented ops raise;
* ``server``: the real SGLang server as a process for tests and the GPU lab's cases (leased ports,
  readiness, stop by PID, its log).

What differs stays in each layer: its seams, its pieces, its fault switches, its server flags. The base is
a distribution of its own (``ddtree-sglang-lab-base``, built from ``scripts/lab/sglang-lab-base/``), beside
whichever layer runs: ``make venv`` installs it before the CPU layer, the runtime role builds it into a lab
release that holds the CPU layer (``ddtree_runtime_lab_cpu_compat``), and ``scripts/lab/gpu/pack.py``
carries its wheel to the device. ``tests/unit/test_lab_base.py`` fails when a layer grows its own copy
again.
"""

from __future__ import annotations

# The SGLang release both layers were read against (each layer's seams refuse another).
PINNED_SGLANG_VERSION = "0.5.23"
