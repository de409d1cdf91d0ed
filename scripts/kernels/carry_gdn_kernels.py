"""Copy SGLang 0.5.23's GDN tree-verify kernel files (conv, recurrent) and the commit's scatter
kernels out of the installed wheel, for a machine without SGLang (the device):
``python scripts/kernels/carry_gdn_kernels.py DEST``, then run with ``PYTHONPATH=DEST``.

The kernel files are copied byte for byte. The helper modules they import from SGLang
(``sglang.kernels.jit.utils`` for ``is_arch_support_pdl``, ``sglang.srt.utils`` for the device
probes that pick the launch configuration, ``sglang.srt.utils.common.get_device_core_count``) are
replaced by minimal modules with the same answers, written from SGLang's own definitions
(``kernels/jit/utils/arch.py``, ``srt/utils/common.py``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

KERNELS = (
    "kernels/ops/mamba/causal_conv1d_triton.py",
    "kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py",
    "kernels/ops/mamba/mamba_state_scatter_triton.py",  # the commit's scatter (CUDA only)
    "kernels/ops/memory/ptr_table.py",
)

JIT_UTILS = '''"""Stand-in for sglang.kernels.jit.utils (arch.py): PDL needs a CUDA device of sm_90+."""
import torch


def is_arch_support_pdl() -> bool:
    if torch.version.hip is not None or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability()[0] >= 9
'''

SRT_UTILS = '''"""Stand-in for the sglang.srt.utils probes the GDN kernels import (as common.py has them)."""
import torch


def is_hip() -> bool:
    return torch.version.hip is not None


def is_cuda() -> bool:
    return torch.cuda.is_available() and torch.version.cuda is not None


def get_device_sm() -> int:
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor
    return 0


def is_gfx95_supported() -> bool:
    return False  # never on a CUDA build


def is_sm90_supported() -> bool:
    if not is_cuda():
        return False
    cuda = tuple(int(x) for x in torch.version.cuda.split(".")[:2])
    return torch.cuda.get_device_capability()[0] == 9 and cuda >= (12, 3)
'''


SRT_UTILS_COMMON = '''"""Stand-in for sglang.srt.utils.common: the one probe the scatter kernels import."""
import torch

from sglang.srt.utils import *  # noqa: F403


def get_device_core_count(device_id: int = 0) -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(device_id).multi_processor_count
    return 0
'''


def carry(dest: Path) -> dict:
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec("sglang")  # located, not imported (its import chain is heavy)
    if spec is None or spec.origin is None:
        raise SystemExit("sglang is not installed in this interpreter (make venv installs it)")
    src_root = Path(spec.origin).parent
    pkg = dest / "sglang"
    if pkg.exists():
        shutil.rmtree(pkg)
    copied = {}
    for rel in KERNELS:
        target = pkg / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        data = (src_root / rel).read_bytes()
        target.write_bytes(data)
        copied[rel] = hashlib.sha256(data).hexdigest()[:16]
    (pkg / "kernels" / "jit").mkdir(parents=True, exist_ok=True)
    (pkg / "kernels" / "jit" / "utils.py").write_text(JIT_UTILS)
    (pkg / "srt" / "utils").mkdir(parents=True, exist_ok=True)
    (pkg / "srt" / "utils" / "__init__.py").write_text(SRT_UTILS)
    (pkg / "srt" / "utils" / "common.py").write_text(SRT_UTILS_COMMON)
    for d in [pkg, *[p for p in pkg.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()
    return {"sglang_version": importlib.metadata.version("sglang"), "kernels": copied}


if __name__ == "__main__":
    print(json.dumps(carry(Path(sys.argv[1]))))
