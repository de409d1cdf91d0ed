"""SGLang limitation: the DFlash drafter's attention fuses its q/k RMSNorm and RoPE into one Triton kernel
(``table_qk_norm_rope_``, chosen in ``DFlashAttention.__init__`` for bf16 neox-rope layers). On a CPU that
kernel runs only in Triton's interpreter: about 1 s per call for a 16-token block, over 80 % of a
DDTREE round on the lab pair. The layer's own unfused path (``apply_qk_norm`` then ``rotary_emb``, the
same two steps the target's layers take) computes the same q and k; this turns the fused choice off
for every DFlash attention layer built in a process where the layer is on.
``tests/sglang/test_cpu_lab_drafter_rope.py`` checks the two paths give the same q and k.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ddtree_sglang_lab_base.hooks import after_import

from ddtree_sglang_cpu_lab.seams import require


def _unfused_qk_norm_rope(module: ModuleType) -> None:
    require(module, module.__name__, "DFlashAttention.__init__")
    require(module, module.__name__, "DFlashAttention.forward")
    attention = module.DFlashAttention
    init = attention.__init__

    def init_unfused(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.use_table_qk_norm_rope = False

    init_unfused.__wrapped__ = init  # type: ignore[attr-defined]
    attention.__init__ = init_unfused


def install() -> None:
    after_import("sglang.srt.models.dflash", _unfused_qk_norm_rope)
