"""The script `ddtree fleet` runs on each host (python3 stdlib only, sent over SSH on stdin).

It prints one JSON object with what the roles left on the host (docs/interfaces.md section 5),
systemd's view of each unit and the GPU memory where nvidia-smi exists. Kept as plain source so
the host needs nothing of ours installed to answer.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

STATE_ROOT = Path("/var/lib/ddtree")


def _run(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _json(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def unit_facts(unit: str) -> dict:
    props = "LoadState,ActiveState,SubState,NRestarts,ActiveEnterTimestampMonotonic,ExecMainStatus"
    out = _run(["systemctl", "show", f"{unit}.service", "-p", props])
    if out is None:
        return {"active": "unknown", "error": "systemctl show failed (no systemd?)"}
    f = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    facts = {"loaded": f.get("LoadState"), "active": f.get("ActiveState"), "sub": f.get("SubState"),
             "restarts": _int(f.get("NRestarts")), "uptime_seconds": None}
    entered = _int(f.get("ActiveEnterTimestampMonotonic"))
    if f.get("ActiveState") == "active" and entered:
        facts["uptime_seconds"] = round(time.clock_gettime(time.CLOCK_MONOTONIC) - entered / 1e6, 1)
    return facts


def _int(text: str | None) -> int:
    return int(text) if text and text.isdigit() else 0


def last_probe(unit: str) -> dict | None:
    rep = _json(STATE_ROOT / "probe" / f"{unit}.json")
    if rep is None:
        return None
    figures = rep.get("figures") or {}
    keep = ("probe", "ok", "cause", "time", "message")
    # What the server decodes with (the live probe's record_decoder): the controller checks it.
    return {**{k: rep.get(k) for k in keep}, "accept_length": figures.get("accept_length"),
            "setting": figures.get("setting"), "decoder": figures.get("decoder")}


def counterfactual(unit: str) -> dict | None:
    """The counters `ddtree metrics record-counterfactual` stored for the unit, as stored: the controller
    checks them (core/counterfactual_invariants.py) and estimates (docs/counterfactual-acceptance.md)."""
    doc = _json(STATE_ROOT / "counterfactual" / f"{unit}.json")
    if doc is None or not isinstance(doc.get("counts"), dict):
        return None
    return {k: doc.get(k) for k in ("time", "counts", "horizon", "running")}


def gpus() -> list[dict] | None:
    if shutil.which("nvidia-smi") is None:
        return None
    out = _run(["nvidia-smi", "--query-gpu=index,name,memory.used,memory.total",
                "--format=csv,noheader,nounits"])
    if out is None:
        return []
    rows = []
    for line in out.strip().splitlines()[:64]:
        try:
            idx, name, used, total = (p.strip() for p in line.split(","))
            rows.append({"index": int(idx), "name": name, "memory_used_mib": int(used),
                         "memory_total_mib": int(total)})
        except ValueError:  # "[N/A]" and other non-figures: that GPU's row stays out
            continue
    return rows


def main(units: list[str]) -> None:
    doc = {"hostname": socket.gethostname(), "time": time.time(), "gpus": gpus(), "units": {}}
    for unit in units:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,99}", unit) or ".." in unit:
            continue  # never a path outside the state directories (the controller refuses such names)
        state = _json(STATE_ROOT / "state" / f"{unit}.json")
        doc["units"][unit] = {"systemd": unit_facts(unit), "state": state, "probe": last_probe(unit),
                              "counterfactual": counterfactual(unit)}
    json.dump(doc, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:] or ["sglang-qwen"])
