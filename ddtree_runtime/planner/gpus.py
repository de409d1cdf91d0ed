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
_SHORTHAND = re.compile(r"^\s*(\d{1,3})\s*[x×*]\s*([A-Za-z0-9_.-]{1,40})\s*$")
# A host with more GPUs, or a GPU with more memory (MiB), than these is a typo, not a host.
MAX_GPUS = 64
MAX_GPU_MIB = 1 << 22


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
        count = int(m.group(1))
        if not 1 <= count <= MAX_GPUS - len(out):
            raise PlanError(f"cannot read GPUs {part.strip()!r}: 1..{MAX_GPUS} GPUs per host")
        out += [GpuFacts(len(out) + i, name, total, idle, "shorthand") for i in range(count)]
    if not out:
        raise PlanError("no GPUs given")
    return out


def _mib(text: str) -> int:
    value = text.strip().removesuffix("MiB").strip()
    try:
        mib = int(float(value))
    except (ValueError, OverflowError):
        raise PlanError(f"nvidia-smi gave a memory figure that is not a number: {text[:40]!r}") from None
    if not 0 <= mib <= MAX_GPU_MIB:
        raise PlanError(f"nvidia-smi gave an impossible memory figure: {text[:40]!r} MiB")
    return mib


def _index(text: str) -> int:
    if not re.fullmatch(r"\s*\d{1,2}\s*", text) or int(text) >= MAX_GPUS:
        raise PlanError(f"nvidia-smi gave a GPU index that is not one: {text[:40]!r} (0..{MAX_GPUS - 1})")
    return int(text)


def _checked(gpus: list[GpuFacts], where: str) -> list[GpuFacts]:
    """One entry per GPU index, free <= total: anything else is not what a host reports."""
    if len(gpus) > MAX_GPUS:
        raise PlanError(f"{where} lists {len(gpus)} GPUs: a host has at most {MAX_GPUS}")
    seen: set[int] = set()
    for g in gpus:
        if g.index in seen:
            raise PlanError(f"{where} lists GPU {g.index} twice")
        seen.add(g.index)
        if g.total_mib < 1 or not 0 <= g.free_mib <= g.total_mib:
            raise PlanError(f"{where}: GPU {g.index} has {g.free_mib} MiB free of {g.total_mib} MiB: "
                            "free must be between 0 and the total")
        if len(g.name) > 100:
            raise PlanError(f"{where}: GPU {g.index}'s name is {len(g.name)} characters long")
    return gpus


def parse_nvidia_smi_csv(text: str) -> list[GpuFacts]:
    """Rows of ``nvidia-smi --query-gpu=index,name,memory.total,memory.free --format=csv[,...]``."""
    try:
        rows = [r for r in csv.reader(io.StringIO(text), skipinitialspace=True) if any(c.strip() for c in r)]
    except csv.Error as exc:
        raise PlanError(f"nvidia-smi output is not CSV: {exc}") from None
    if len(rows) > MAX_GPUS + 1:
        raise PlanError(f"nvidia-smi output has {len(rows)} rows: a host has at most {MAX_GPUS} GPUs")
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
                index=_index(cell["index"]),
                name=cell["name"].strip(),
                total_mib=_mib(cell["memory.total"]),
                free_mib=_mib(cell["memory.free"]),
                source="nvidia-smi",
            )
        )
    return _checked(sorted(out, key=lambda g: g.index), "nvidia-smi")


def from_declared(entries: Iterable[dict[str, Any]] | dict[str, Any]) -> list[GpuFacts]:
    """The inventory's ``ddtree_gpus``: a list of ``{name, count?, memory_total_mib?, memory_free_mib?}``.

    A known name may leave the memory out (the catalogue has nvidia-smi's figure); free memory
    defaults to what an idle GPU has free (the total less ``IDLE_RESERVED_MIB``).
    """
    if isinstance(entries, dict):
        entries = [entries]
    if not isinstance(entries, list) or len(entries) > MAX_GPUS:
        raise PlanError(f"ddtree_gpus must be a list of {{name, count, ...}} entries, got "
                        f"{str(entries)[:60]!r}")
    out: list[GpuFacts] = []
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"].strip():
            raise PlanError(f"ddtree_gpus entries need a name, got {str(entry)[:60]!r}")
        known = _known(entry["name"])
        total = entry.get("memory_total_mib") or (known[1] if known else None)
        if total is None:
            raise PlanError(
                f"ddtree_gpus: {entry['name'][:40]!r} is not a GPU the planner knows; give memory_total_mib "
                "(nvidia-smi's memory.total)"
            )
        count = _declared_int(entry, "count", entry.get("count", 1), 1, MAX_GPUS - len(out))
        total = _declared_int(entry, "memory_total_mib", total, 1, MAX_GPU_MIB)
        idle = max(1, total - IDLE_RESERVED_MIB)
        free = _declared_int(entry, "memory_free_mib", entry.get("memory_free_mib", idle), 0, total)
        name = known[0] if known else entry["name"]
        out += [GpuFacts(len(out) + i, name, total, free, "inventory") for i in range(count)]
    if not out:
        raise PlanError("ddtree_gpus is empty")
    return _checked(out, "ddtree_gpus")


def _declared_int(entry: dict[str, Any], key: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise PlanError(f"ddtree_gpus: {key} of {str(entry.get('name'))[:40]!r} must be a whole number in "
                        f"{low}..{high} (count: GPUs of the host, at most {MAX_GPUS} in all; free <= total), "
                        f"got {str(value)[:40]!r}")
    return value


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
        if len(set(visible)) != len(visible):
            shown = ",".join(map(str, visible))
            raise PlanError(f"CUDA_VISIBLE_DEVICES {shown} names a GPU twice: two ranks cannot share one GPU")
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
