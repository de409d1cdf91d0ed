"""`ddtree fleet status`'s rows: each host's answer from `fleet_remote.py` (stdlib python3 on the host,
sent on stdin), checked field by field, plus each router's view of the rotation."""

from __future__ import annotations

import json
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddtree_runtime.health import counterfactual_counters
from ddtree_runtime.ops.fleet_decoder import decoder_cells
from ddtree_runtime.ops.fleet_inventory import RouterTarget, Target
from ddtree_runtime.ops.fleet_ssh import run_remote, why_unreachable

LIVE_UNIT = "sglang-qwen"
REMOTE_SCRIPT = Path(__file__).with_name("fleet_remote.py")
ROUTER_SCRIPT = Path(__file__).with_name("router_remote.py")


@dataclass
class Row:
    host: str
    unit: str
    reachable: bool
    error: str | None = None
    active: str | None = None
    uptime_seconds: float | None = None
    restarts: int | None = None
    profile: str | None = None
    release: str | None = None
    deployed_at: str | None = None
    probe_ok: bool | None = None
    probe_cause: str | None = None
    probe_time: float | None = None
    accept_length: float | None = None
    gpu_memory: list[dict] | None = field(default=None)
    rotation: list[str] | None = None  # "ROUTER: in | out | in (unhealthy)" per router in front of the host
    # {"rounds", "tokens_per_round": {budget: float}} or {"refused": why}: docs/counterfactual-acceptance.md
    counterfactual: dict | None = None
    # What the server decodes with, as its last live probe read /server_info (fleet_decoder)
    setting: str | None = None
    widths: str | None = None  # an adaptive server's width per batch size and rounds per width
    prices: str | None = None  # its start-up round prices

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _as(kind: type | tuple[type, ...], value: Any) -> Any:
    """The value when it has the type a row cell needs, else None (a host's answer is not trusted)."""
    if isinstance(value, bool) and kind is not bool:
        return None
    if kind is float and isinstance(value, int | float):
        return float(value) if value == value and abs(value) < 1e15 else None
    if kind is str and isinstance(value, str):
        return value[:200]
    return value if isinstance(value, kind) else None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _gpu_rows(value: Any) -> list[dict] | None:
    if value is None or not isinstance(value, list):
        return None
    rows = []
    for g in value[:64]:
        g = _dict(g)
        used, total = _as(float, g.get("memory_used_mib")), _as(float, g.get("memory_total_mib"))
        if used is None or total is None:
            continue
        rows.append({"index": _as(int, g.get("index")), "name": _as(str, g.get("name")),
                     "memory_used_mib": used, "memory_total_mib": total})
    return rows


def _counterfactual(value: Any) -> dict | None:
    """The host's stored counters, checked as the server's own and estimated here (the host's answer is
    not trusted): {"rounds", "tokens_per_round": {label: float}}, or {"refused": why} for counters no
    scorer can emit."""
    if not isinstance(value, dict) or not isinstance(value.get("counts"), dict):
        return None
    try:
        counters = counterfactual_counters.counters_from_state(value)
    except ValueError as exc:
        return {"refused": " ".join(str(exc).split())[:300]}
    tpr = {e.label: round(e.tokens_per_round, 3) for e in counterfactual_counters.estimates(counters)}
    return {"rounds": counters.rounds_scored, "tokens_per_round": tpr}


def rows_from_facts(host: str, facts: Any, units: list[str]) -> list[Row]:
    """The table's rows from one host's answer; fields of the wrong type become '-', and an answer
    that is not the fact script's object is an error row for that host alone."""
    if not isinstance(facts, dict) or not isinstance(facts.get("units", {}), dict):
        shown = json.dumps(facts)[:80] if not isinstance(facts, str) else facts[:80]
        error = f"malformed answer from the fact script: {shown}"
        return [Row(host=host, unit=u, reachable=True, error=error) for u in units]
    rows = []
    for unit in units:
        u = _dict(_dict(facts.get("units")).get(unit))
        sd, state, probe = _dict(u.get("systemd")), _dict(u.get("state")), _dict(u.get("probe"))
        active = _as(str, sd.get("active"))
        restarts = _as(int, sd.get("restarts"))
        sub = _as(str, sd.get("sub"))
        if sd.get("loaded") == "not-found":
            active, restarts = "not-installed", None
        elif sub and sub != active and active not in (None, "unknown"):
            active = f"{active} ({sub})"
        decoder = decoder_cells(probe)
        rows.append(Row(
            host=host, unit=unit, reachable=True, active=active,
            uptime_seconds=_as(float, sd.get("uptime_seconds")), restarts=restarts,
            profile=_as(str, state.get("profile")), release=_as(str, state.get("release")),
            deployed_at=_as(str, state.get("deployed_at")), probe_ok=_as(bool, probe.get("ok")),
            probe_cause=_as(str, probe.get("cause")), probe_time=_as(float, probe.get("time")),
            accept_length=_as(float, probe.get("accept_length")), gpu_memory=_gpu_rows(facts.get("gpus")),
            counterfactual=_counterfactual(u.get("counterfactual")),
            setting=decoder.setting, widths=decoder.widths, prices=decoder.prices,
        ))
    return rows


def host_status(t: Target, units: list[str]) -> list[Row]:
    command = "python3 - " + " ".join(shlex.quote(u) for u in units)
    try:
        rc, out, err = run_remote(t, command, REMOTE_SCRIPT.read_text())
    except Exception as exc:  # any connection failure is a row, never a crash
        return [Row(host=t.name, unit=u, reachable=False, error=why_unreachable(t, exc)) for u in units]
    try:
        facts = json.loads(out)
    except (ValueError, RecursionError):
        reason = f"fact script failed (exit {rc}): {(err or out).strip().splitlines()[-1:] or ['no output']}"
        return [Row(host=t.name, unit=u, reachable=True, error=reason[:300]) for u in units]
    return rows_from_facts(t.name, facts, units)


def router_script(port: int, key: str) -> str:
    """router_remote.py with the router's port and key in its CONFIG line."""
    marker = "CONFIG: dict = {}"
    text = ROUTER_SCRIPT.read_text()
    assert marker in text, f"{ROUTER_SCRIPT} lost its CONFIG line"
    return text.replace(marker, f"CONFIG: dict = {json.dumps({'port': port, 'key': key})}", 1)


def router_workers(router: RouterTarget) -> Any:
    """The router's GET /workers answer (over SSH, on its own loopback), or {"error": why}. Any JSON
    value may come back: rotation_states checks it."""
    script = router_script(router.port, router.key)
    try:
        _rc, out, err = run_remote(router.target, "python3 -", script)
        return json.loads(out)
    except (ValueError, RecursionError):
        return {"error": f"router script failed: {(err or out).strip().splitlines()[-1:] or ['no output']}"}
    except Exception as exc:
        return {"error": why_unreachable(router.target, exc)}


def rotation_states(routers: list[RouterTarget]) -> dict[str, list[str]]:
    """host -> 'ROUTER: in | out | in (unhealthy) | ? (why)' per router it is configured behind. An
    answer that is not a worker list of checked entries ([], 5, workers that are not objects) is that
    router's '?' with the reason, never a crash."""
    from ddtree_runtime.inputs.values import InputError
    from ddtree_runtime.ops.rotation import Member, RouterView, host_states

    states: dict[str, list[str]] = {}
    for router in routers:
        answer = router_workers(router)
        why = None
        if isinstance(answer, dict) and "error" in answer:
            why = _as(str, answer["error"]) or "error"
        elif not isinstance(answer, dict) or not isinstance(answer.get("workers"), list):
            why = f"malformed answer: {json.dumps(answer)[:60]} is not a worker list"
        else:
            try:
                view = RouterView(router.target.name, tuple(Member(h, a) for h, a in router.members),
                                  tuple(answer["workers"]))
            except InputError as exc:
                why = f"malformed answer: {str(exc)[:160]}"
        if why is not None:
            for host, _ in router.members:
                states.setdefault(host, []).append(f"{router.target.name}: ? ({why})")
            continue
        for host, cells in host_states([view]).items():
            states.setdefault(host, []).extend(cells)
    return states


def fleet_status(targets: list[Target], units: list[str], *, forks: int = 10,
                 progress: bool = False, routers: list[RouterTarget] | None = None) -> list[Row]:
    rows: dict[str, list[Row]] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(forks, len(targets)))) as pool:
        futures = {pool.submit(host_status, t, units): t for t in targets}
        for n, fut in enumerate(as_completed(futures), 1):
            t = futures[fut]
            try:
                rows[t.name] = fut.result()
            except Exception as exc:  # one host's surprise stays in its own rows
                rows[t.name] = [Row(host=t.name, unit=u, reachable=True,
                                    error=f"could not read its answer: {type(exc).__name__}: {exc}"[:300])
                                for u in units]
            if progress:
                print(f"fleet: {t.name} answered ({n}/{len(targets)})", file=sys.stderr, flush=True)
    rotation = rotation_states(routers or [])
    for host_rows in rows.values():
        for row in host_rows:
            if row.unit == LIVE_UNIT and row.host in rotation:
                row.rotation = rotation[row.host]
    return [row for t in targets for row in rows[t.name]]  # inventory order
