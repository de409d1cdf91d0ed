"""Which decoder a shipped profile runs, the chain or a tree budget, from the figures (issue 33).

A **live** profile runs the setting with the most tokens/s at the concurrency it is sized for (its
``max-running-requests``) on the GPU it is meant for (``runs_on``), among the settings that fit there
(``ddtree plan``), priced by ``ddtree tune``'s round-cost model (``tune.round_ms``: measured on the
H200 at Qwen3.6-27B's shape, a stated bandwidth model elsewhere) with tokens per round per setting
from the lab pairs (the caller says which; they are not Qwen3.6-27B's own drafter).

A **shadow** runs what the live profile it canaries runs: the canary compares the two sides' accept
lengths (``sglang_canary_min_accept_ratio``), so a chain shadow beside a tree live would fail every
canary, and a shadow at another budget canaries another setting than the one that ships. Its budget
is live's where that fits its GPU; only memory makes it smaller.

``docs/bench/profile-choice.md`` holds the table and its sources; ``tests/unit/test_profile_choice.py``
fails when a profile's setting and its figures part.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ddtree_runtime.core.decoder_settings import AUTO
from ddtree_runtime.planner.tune import CHAIN, round_ms

LIVE_PORT = 30000  # profiles.yml: live services listen here, shadows on their own port
# The GPU lab's hybrid pair servers whose acceptance prices each setting (docs/bench/profile-choice.md).
LAB_HYBRID_SERVERS = {CHAIN: "hybrid-dflash", "16": "hybrid-ddtree-b16", "32": "hybrid-ddtree-b32"}


def lab_tokens_per_round(
    lines: Iterable[str], servers: Mapping[str, str] = LAB_HYBRID_SERVERS
) -> dict[str, float]:
    """Accept length (tokens per round, the bonus token included) per setting, from the GPU lab's
    ``bench_summary`` lines; lines that are not JSON (pytest's own output in the same file) are skipped."""
    found: dict[str, float] = {}
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        for label, server in servers.items():
            if row.get("case") == "bench_summary" and row.get("server") == server:
                found[label] = float(row["accept_length"])
    return found


@dataclass(frozen=True)
class Choice:
    """What the figures say for one profile, and why."""

    profile: str
    runs: str  # the setting the profile's flags run: "chain" or a budget
    chosen: str  # the setting the rule picks
    concurrency: int
    gpu: str
    tp: int
    reason: str
    tokens_per_s: dict[str, float] = field(default_factory=dict)  # per priced setting (live profiles)

    @property
    def agrees(self) -> bool:
        return self.runs == self.chosen

    def ratio_to_chain(self, setting: str) -> float | None:
        chain = self.tokens_per_s.get(CHAIN)
        mine = self.tokens_per_s.get(setting)
        return None if not chain or mine is None else mine / chain


def profile_setting(flags: Mapping[str, Any]) -> str:
    """The setting a profile's flags run: the chain is DDTREE's top-k cap 1 (any budget)."""
    if flags.get("speculative-ddtree-topk-cap") == 1:
        return CHAIN
    budget = flags.get("speculative-ddtree-budget")
    if isinstance(budget, str) and (budget.strip() == AUTO or "," in budget):
        raise ValueError(f"speculative-ddtree-budget {budget!r} is adaptive, which no figures choose: a "
                         "shipped profile pins one budget (or the chain); a host runs auto through its "
                         "host_vars (sglang_service_flag_overrides, docs/runbook.md)")  # fmt: skip
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"speculative-ddtree-budget must be a positive integer, got {budget!r}")
    return str(budget)


def profile_gpu(profile: Mapping[str, Any]) -> tuple[str, int]:
    """``runs_on.gpus`` (``1xH200``, ``2xA6000``) -> (GPU kind, tensor-parallel size from the flags)."""
    spec = str(profile.get("runs_on", {}).get("gpus", ""))
    count, sep, kind = spec.partition("x")
    if not sep or not count.isdigit() or not kind:
        raise ValueError(f"runs_on.gpus must read COUNTxNAME (1xH200), got {spec!r}")
    return kind, int(profile.get("flags", {}).get("tp-size", 1))


def is_live(profile: Mapping[str, Any]) -> bool:
    return int(profile.get("port", LIVE_PORT)) == LIVE_PORT


def choose_live(
    name: str, profile: Mapping[str, Any], tokens_per_round: Mapping[str, float],
    fits: Callable[[str], bool],
) -> Choice:  # fmt: skip
    """The fastest setting that fits, at the profile's sized concurrency on its GPU."""
    flags = profile["flags"]
    gpu, tp = profile_gpu(profile)
    concurrency = int(flags["max-running-requests"])
    priced = {
        label: concurrency * tpr / round_ms(label, concurrency, gpu=gpu, tp=tp) * 1e3
        for label, tpr in tokens_per_round.items()
        if fits(label)
    }
    if not priced:
        raise ValueError(f"{name}: no setting with figures fits {gpu} x{tp}")
    chosen = max(priced, key=lambda label: priced[label])
    left_out = sorted(set(tokens_per_round) - set(priced))
    reason = f"most tokens/s at concurrency {concurrency} on {tp}x{gpu}"
    if left_out:
        reason += f" (does not fit: {', '.join(left_out)})"
    return Choice(name, profile_setting(flags), chosen, concurrency, gpu, tp, reason, priced)


def choose_shadow(name: str, profile: Mapping[str, Any], live: Choice, fits: Callable[[str], bool]) -> Choice:
    """Live's setting where it fits the shadow's GPU; else the largest smaller budget that does."""
    flags = profile["flags"]
    gpu, tp = profile_gpu(profile)
    chosen, reason = live.runs, f"what {live.profile} runs (the canary compares like with like)"
    if live.runs != CHAIN and not fits(live.runs):
        smaller = [b for b in range(int(live.runs) - 1, 0, -1) if fits(str(b))]
        if not smaller:
            raise ValueError(f"{name}: no tree budget up to {live.runs} fits {gpu} x{tp}")
        chosen, reason = str(smaller[0]), f"the largest budget up to {live.runs} that fits {gpu}"
    concurrency = int(flags["max-running-requests"])
    return Choice(name, profile_setting(flags), chosen, concurrency, gpu, tp, reason)


def live_profile_of(profile: Mapping[str, Any], default: str = "balanced") -> str:
    """The live profile a shadow canaries: ``runs_on.beside`` where stated, else ``balanced``."""
    return str(profile.get("runs_on", {}).get("beside") or default)
