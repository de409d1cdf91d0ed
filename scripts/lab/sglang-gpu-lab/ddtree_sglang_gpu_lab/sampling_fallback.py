"""DFLASH's sampling verify without flashinfer: SGLang's own fallback, chosen explicitly.

SGLang limitation: DFLASH's non-greedy verify (``kernels/ops/speculative/sampling.py``,
``tree_speculative_sampling_target_only``) is compiled at run time against flashinfer's C++ headers
(``kernels/jit/utils/deps.py`` ~52: "Cannot find flashinfer package"), and ``prewarm_sampling``
compiles it at start-up. flashinfer (62 MB) does not travel to the device.

SGLang has a path for a build without that kernel: ``is_dflash_sampling_verify_available()`` False,
``prewarm_sampling`` skips the rehearsal and DFLASH verifies greedily at T > 0 with a warning
("DFLASH non-greedy verification is unavailable on this build/device"). The lab takes that path:
DFLASH at T > 0 is not lossless sampling in the GPU lab (its greedy verify is unchanged). DDTREE does
not use this kernel (its T > 0 walk is ``ddtree_runtime.core.tree.walk_sample``), so nothing DDTREE
computes changes.
"""

from __future__ import annotations

from types import ModuleType

MODULE = "sglang.srt.speculative.dflash_utils"


def _take_fallback(module: ModuleType) -> None:
    from ddtree_sglang_gpu_lab.seams import require

    require(module, MODULE, "is_dflash_sampling_verify_available")
    module._DFLASH_SAMPLING_VERIFY_AVAILABLE = False


def install() -> None:
    from ddtree_sglang_lab_base.hooks import after_import

    after_import(MODULE, _take_fallback)
