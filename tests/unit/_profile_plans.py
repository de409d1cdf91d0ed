"""Plan a shipped profile on the hardware its ``runs_on`` names (beside its live profile, for shadows):
the one way test_planner and test_profile_choice place a profile."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ddtree_runtime.planner import plan_memory
from ddtree_runtime.planner.accounting import Plan
from ddtree_runtime.planner.cli import live_claim
from ddtree_runtime.planner.gpus import GpuFacts, parse_shorthand
from ddtree_runtime.planner.settings import from_flags


def plan_where_meant(
    pair: Any, profiles: Mapping[str, Any], name: str, flags: Mapping[str, Any] | None = None
) -> Plan:
    """``flags`` (default: the profile's own) planned where profile ``name`` is meant to run."""
    runs_on = profiles[name]["runs_on"]
    gpus = parse_shorthand(runs_on["gpus"])
    if runs_on.get("free_mib"):
        gpus = [GpuFacts(g.index, g.name, g.total_mib, int(runs_on["free_mib"])) for g in gpus]
    claimed = None
    if runs_on.get("beside"):
        claimed = live_claim(pair, gpus, from_flags(profiles[runs_on["beside"]]["flags"]), None)
    visible = [int(i) for i in str(runs_on.get("cuda_visible_devices", "")).split(",") if i != ""] or None
    chosen = profiles[name]["flags"] if flags is None else flags
    return plan_memory(pair, gpus, from_flags(chosen), profile=name, visible=visible, claimed_gib=claimed)
