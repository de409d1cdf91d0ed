"""GPU facts: how many, which, how much memory in total and free, per GPU.

Three sources, one shape (:class:`GpuFacts`): ``nvidia-smi --query-gpu=index,name,memory.total,
memory.free,memory.used --format=csv`` on a GPU host (with or without ``noheader,nounits``); the
inventory's ``ddtree_gpus`` (lab hosts, and what a production host is expected to have); and a
shorthand for the command line (``1xH200``, ``2xA6000``).
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from ddtree_runtime.planner.shapes import PlanError

NVIDIA_SMI_QUERY = "index,name,memory.total,memory.free,memory.used"
NVIDIA_SMI_COMMAND = ["nvidia-smi", f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits"]

# What nvidia-smi reports as memory.total (MiB) for the GPUs this fleet meets; the key is matched
# against the shorthand and against nvidia-smi's name.
# An idle GPU is not all free: nvidia-smi on an idle H200 reports 143156 of 143771 MiB free with nothing
# running (tests/unit/data/nvidia-smi-h200.csv); the same reserve is assumed for the others.
IDLE_RESERVED_MIB = 615
KNOWN_GPUS: dict[str, tuple[str, int]] = {
    "h200": ("NVIDIA H200", 143771),
    "h100": ("NVIDIA H100 80GB HBM3", 81559),
    "a100-80gb": ("NVIDIA A100-SXM4-80GB", 81920),
    "a100-40gb": ("NVIDIA A100-SXM4-40GB", 40960),
    "a6000": ("NVIDIA RTX A6000", 49140),
    "l40s": ("NVIDIA L40S", 46068),
}
_SHORTHAND = re.compile(r"^\s*(\d+)\s*[x×*]\s*([A-Za-z0-9_.-]+)\s*$")


@dataclass(frozen=True)
class GpuFacts:
    index: int
    name: str
    total_mib: int
    free_mib: int
    source: str = "declared"

    @property
    def total_gib(self) -> float:
        return self.total_mib / 1024

    @property
    def free_gib(self) -> float:
        return self.free_mib / 1024

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _known(name: str) -> tuple[str, int] | None:
    key = name.strip().lower().removeprefix("nvidia").strip().replace(" ", "-").removeprefix("rtx-")
    if key in KNOWN_GPUS:
        return KNOWN_GPUS[key]
    for full, total in KNOWN_GPUS.values():
        if full.lower() == name.strip().lower():
            return full, total
    return None


def parse_shorthand(text: str) -> list[GpuFacts]:
    """``2xA6000`` -> two idle RTX A6000s; several groups with commas (``1xH200,1xA6000``)."""
    out: list[GpuFacts] = []
    for part in text.split(","):
        m = _SHORTHAND.match(part)
        known = _known(m.group(2)) if m else None
        if m is None or known is None:
            names = ", ".join(k.upper() for k in KNOWN_GPUS)
            raise PlanError(
                f"cannot read GPUs {part.strip()!r}: write COUNTxNAME with NAME one of {names} "
                "(e.g. 1xH200, 2xA6000), or give nvidia-smi's CSV with --gpus-csv"
            )
        name, total = known
        idle = total - IDLE_RESERVED_MIB
        out += [GpuFacts(len(out) + i, name, total, idle, "shorthand") for i in range(int(m.group(1)))]
    if not out:
        raise PlanError("no GPUs given")
    return out


def _mib(text: str) -> int:
    value = text.strip().removesuffix("MiB").strip()
    try:
        return int(float(value))
    except ValueError:
        raise PlanError(f"nvidia-smi gave a memory figure that is not a number: {text!r}") from None


def parse_nvidia_smi_csv(text: str) -> list[GpuFacts]:
    """Rows of ``nvidia-smi --query-gpu=index,name,memory.total,memory.free --format=csv[,...]``."""
    rows = [r for r in csv.reader(io.StringIO(text), skipinitialspace=True) if any(c.strip() for c in r)]
    if not rows:
        raise PlanError("nvidia-smi printed no GPUs (is the driver loaded? `nvidia-smi -L` lists them)")
    columns = ["index", "name", "memory.total", "memory.free"]
    if rows[0] and rows[0][0].strip().lower() == "index":
        columns = [c.strip().split(" [")[0].lower() for c in rows[0]]
        rows = rows[1:]
    missing = {"index", "name", "memory.total", "memory.free"} - set(columns)
    if missing:
        raise PlanError(f"nvidia-smi output lacks {', '.join(sorted(missing))}: query {NVIDIA_SMI_QUERY}")
    out = []
    for row in rows:
        if len(row) < len(columns):
            raise PlanError(f"nvidia-smi row has {len(row)} fields, expected {len(columns)}: {row!r}")
        cell = dict(zip(columns, row, strict=False))
        out.append(
            GpuFacts(
                index=int(cell["index"]),
                name=cell["name"].strip(),
                total_mib=_mib(cell["memory.total"]),
                free_mib=_mib(cell["memory.free"]),
                source="nvidia-smi",
            )
        )
    return sorted(out, key=lambda g: g.index)


def from_declared(entries: Iterable[dict[str, Any]] | dict[str, Any]) -> list[GpuFacts]:
    """The inventory's ``ddtree_gpus``: a list of ``{name, count?, memory_total_mib?, memory_free_mib?}``.

    A known name may leave the memory out (the catalogue has nvidia-smi's figure); free memory
    defaults to what an idle GPU has free (the total less ``IDLE_RESERVED_MIB``).
    """
    if isinstance(entries, dict):
        entries = [entries]
    out: list[GpuFacts] = []
    for entry in entries:
        if not isinstance(entry, dict) or not entry.get("name"):
            raise PlanError(f"ddtree_gpus entries need a name, got {entry!r}")
        known = _known(str(entry["name"]))
        total = entry.get("memory_total_mib") or (known[1] if known else None)
        if total is None:
            raise PlanError(
                f"ddtree_gpus: {entry['name']!r} is not a GPU the planner knows; give memory_total_mib "
                "(nvidia-smi's memory.total)"
            )
        count = int(entry.get("count", 1))
        free = int(entry.get("memory_free_mib", max(1, int(total) - IDLE_RESERVED_MIB)))
        if count < 1 or int(total) < 1 or not 0 <= free <= int(total):
            raise PlanError(f"ddtree_gpus: impossible entry {entry!r} (count >= 1, 0 <= free <= total)")
        name = known[0] if known else str(entry["name"])
        out += [GpuFacts(len(out) + i, name, int(total), free, "inventory") for i in range(count)]
    if not out:
        raise PlanError("ddtree_gpus is empty")
    return out


def select(
    gpus: list[GpuFacts],
    *,
    tp: int,
    base_gpu_id: int = 0,
    gpu_id_step: int = 1,
    visible: list[int] | None = None,
) -> list[GpuFacts]:
    """The GPUs the server's TP ranks land on: rank r gets visible device base + r * step."""
    pool = gpus
    if visible is not None:
        by_index = {g.index: g for g in gpus}
        absent = [i for i in visible if i not in by_index]
        if absent:
            raise PlanError(
                f"CUDA_VISIBLE_DEVICES names GPU(s) {absent} but the host has GPUs {sorted(by_index)}"
            )
        pool = [by_index[i] for i in visible]
    wanted = [base_gpu_id + r * gpu_id_step for r in range(tp)]
    if wanted[-1] >= len(pool) or base_gpu_id < 0:
        have = ", ".join(f"{g.index}: {g.name}" for g in pool) or "none"
        raise PlanError(
            f"tp-size {tp} from base GPU {base_gpu_id} needs {len(wanted)} GPU(s) at positions {wanted}, "
            f"the host offers {len(pool)} ({have})"
        )
    return [pool[i] for i in wanted]
