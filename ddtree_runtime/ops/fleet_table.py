"""`ddtree fleet status`'s table: one line per host and unit, a note per host that did not answer."""

from __future__ import annotations

import time

from ddtree_runtime.ops.fleet_status import Row


def _age(seconds: float | None) -> str:
    """3d4h, 2h13m, 5m, 40s: enough for a table."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s >= 86400:
        return f"{s // 86400}d{s % 86400 // 3600}h"
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60}m"
    return f"{s // 60}m" if s >= 60 else f"{s}s"


def _cell(row: Row, key: str, now: float) -> str:
    if key == "active":
        return row.active or "-"
    if key == "uptime":
        return _age(row.uptime_seconds)
    if key == "probe":
        if row.probe_ok is None:
            return "-"
        result = "pass" if row.probe_ok else f"FAIL:{row.probe_cause}"
        return f"{result} ({_age(now - row.probe_time)} ago)" if row.probe_time else result
    if key == "accept":
        return "-" if row.accept_length is None else f"{row.accept_length:.2f}"
    if key == "rotation":
        return "-" if row.rotation is None else "; ".join(row.rotation)
    if key == "counterfactual":
        cf = row.counterfactual
        if cf and cf.get("refused"):
            return f"refused: {cf['refused'][:80]}"
        if not cf or not cf["tokens_per_round"]:
            return "-"
        tpr = cf["tokens_per_round"]
        order = sorted(tpr, key=lambda k: (k != "chain", int(k) if k.isdigit() else 1 << 30))
        cells = " ".join(f"{k}:{tpr[k]:.2f}" for k in order)
        return f"{cells} ({cf['rounds']} rounds)"
    if key == "gpu":
        if not row.gpu_memory:
            return "-" if row.gpu_memory is None else "nvidia-smi failed"
        return " ".join(f"{g['memory_used_mib'] / 1024:.0f}/{g['memory_total_mib'] / 1024:.0f}G"
                        for g in row.gpu_memory)
    value = getattr(row, key)
    return "-" if value is None else str(value)


# DECODER, WIDTHS and ROUND MS are what the last live probe read in /server_info: the setting, an adaptive
# server's width per batch size (runs of sizes) and rounds per width, and its start-up price table.
COLUMNS = (("HOST", "host"), ("UNIT", "unit"), ("STATE", "active"), ("UP", "uptime"),
           ("RESTARTS", "restarts"), ("PROFILE", "profile"), ("RELEASE", "release"),
           ("DECODER", "setting"), ("LAST PROBE", "probe"), ("ACCEPT", "accept"), ("WIDTHS", "widths"),
           ("ROUND MS", "prices"), ("EST TOK/ROUND", "counterfactual"), ("ROTATION", "rotation"),
           ("GPU MEM", "gpu"))


def format_table(rows: list[Row], now: float | None = None) -> str:
    now = time.time() if now is None else now
    table = [[title for title, _ in COLUMNS]]
    notes = []
    for row in rows:
        if not row.reachable or row.error:
            table.append([row.host, row.unit, "UNREACHABLE" if not row.reachable else "ERROR"]
                         + ["-"] * (len(COLUMNS) - 3))
            notes.append(f"{row.host}: {row.error}")
        else:
            table.append([_cell(row, key, now) for _, key in COLUMNS])
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    return "\n".join(lines + notes)
