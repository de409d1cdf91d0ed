"""The smallest changes to a profile that make it fit, each checked by planning it again.

One knob at a time, each moved as little as it must: fewer running requests (with the mamba
state cache shrunk to match when the profile sets it), a different memory fraction, a bfloat16
SSM state, a smaller DDTree budget, a wider tensor-parallel group, a shorter context, a smaller
prefill chunk. When no single knob is enough, pairs are tried (a cheaper state or more GPUs first,
then one of the others).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ddtree_runtime.planner.accounting import Plan, plan_memory
from ddtree_runtime.planner.settings import ServeSettings, from_flags, to_flags
from ddtree_runtime.planner.shapes import PlanError

MAX_PROPOSALS = 6


@dataclass(frozen=True)
class Change:
    flags: dict[str, Any]  # the new values, SGLang spelling
    summary: str  # "max-running-requests 32 -> 12"
    plan: Plan  # the profile planned again with the change

    def to_dict(self) -> dict[str, Any]:
        return {
            "flags": self.flags,
            "summary": self.summary,
            "verdict": self.plan.verdict.status,
            "token_capacity": self.plan.token_capacity,
            "running_requests": self.plan.running_requests,
        }


def propose_changes(
    plan: Plan, *, visible: list[int] | None = None, claimed_gib: dict[int, float] | None = None
) -> list[Change]:
    """Changes (single knobs first, else pairs) after which the profile fits; [] when it already does."""
    if plan.verdict.fits:
        return []

    def replan(settings: ServeSettings) -> Plan | None:
        try:
            return plan_memory(
                plan.pair,
                list(plan.gpus),
                settings,
                profile=plan.profile,
                visible=visible,
                claimed_gib=claimed_gib,
            )
        except PlanError:
            return None

    found = list(_singles(plan.settings, plan, replan))
    if not found:
        for first_flags, first_text in _steps(plan.settings, plan):
            try:
                base = from_flags({**to_flags(plan.settings), **first_flags})
            except PlanError:
                continue
            base_plan = replan(base)
            if base_plan is None:
                continue
            if base_plan.verdict.fits:  # the first moves are enough on their own
                found.append(Change(dict(first_flags), first_text, base_plan))
                continue
            for change in _singles(base, base_plan, replan):
                flags = {**first_flags, **change.flags}
                found.append(Change(flags, f"{first_text}, {change.summary}", change.plan))
    unique: dict[tuple, Change] = {}  # the same flags reached in another order are one change
    for change in found:
        unique.setdefault(tuple(sorted(change.flags.items())), change)
    return list(unique.values())[:MAX_PROPOSALS]


def _settings_with(settings: ServeSettings, flags: dict[str, Any]) -> ServeSettings | None:
    try:
        return from_flags({**to_flags(settings), **flags})
    except PlanError:
        return None


def _first_fit(
    settings: ServeSettings, candidates: list[dict[str, Any]], replan: Callable[[ServeSettings], Plan | None]
) -> tuple[dict[str, Any], Plan] | None:
    for flags in candidates:
        changed = _settings_with(settings, flags)
        if changed is None:
            continue
        result = replan(changed)
        if result is not None and result.verdict.fits:
            return flags, result
    return None


def _largest_fit(
    settings: ServeSettings,
    low: int,
    high: int,
    flags_for: Callable[[int], dict[str, Any]],
    replan: Callable[[ServeSettings], Plan | None],
) -> tuple[dict[str, Any], Plan] | None:
    """The largest n in [low, high] whose flags fit, by bisection: fewer requests, a smaller budget or a
    shorter context never needs more memory, and a search stays a few plans long whatever the range."""
    best = None
    while low <= high:
        mid = (low + high) // 2
        hit = _first_fit(settings, [flags_for(mid)], replan)
        if hit:
            best, low = hit, mid + 1
        else:
            high = mid - 1
    return best


def _singles(
    settings: ServeSettings, plan: Plan, replan: Callable[[ServeSettings], Plan | None]
) -> Iterator[Change]:
    r = plan.resolved
    hybrid = plan.pair.target.hybrid
    ratio = r.mamba_ratio if r else 1
    running = r.requested_running if r else settings.max_running_requests or 48

    # fewer running requests (and, when the profile pins it, a state cache sized to match)
    def fewer(n: int) -> dict[str, Any]:
        flags: dict[str, Any] = {"max-running-requests": n}
        if hybrid and settings.max_mamba_cache_size is not None and settings.max_mamba_cache_size > n * ratio:
            flags["max-mamba-cache-size"] = n * ratio
        return flags

    hit = _largest_fit(settings, 1, running - 1, fewer, replan)
    if hit:
        flags, result = hit
        text = f"max-running-requests {running} -> {flags['max-running-requests']}"
        if "max-mamba-cache-size" in flags:
            text += (
                f" (max-mamba-cache-size {settings.max_mamba_cache_size} -> {flags['max-mamba-cache-size']})"
            )
        yield Change(flags, text, result)

    # memory fraction: up when a pool is short, down when the run-time headroom is
    if r is not None:
        current = round(r.mem_fraction_static, 2)
        if plan.verdict.term == "activations":
            steps = [round(current - 0.01 * i, 2) for i in range(1, int(current * 100))]
        else:
            steps = [round(current + 0.01 * i, 2) for i in range(1, int((0.99 - current) * 100) + 1)]
        hit = _first_fit(settings, [{"mem-fraction-static": f} for f in steps if 0 < f < 1], replan)
        if hit:
            shown = "SGLang's default" if r.mem_fraction_auto else f"{r.mem_fraction_static:.2f}"
            yield Change(
                hit[0], f"mem-fraction-static {shown} -> {hit[0]['mem-fraction-static']:.2f}", hit[1]
            )

    # a bfloat16 recurrent state halves the SSM state and its scratch
    if hybrid and r is not None and r.ssm_dtype == "float32":
        hit = _first_fit(settings, [{"mamba-ssm-dtype": "bfloat16"}], replan)
        if hit:
            yield Change(hit[0], "mamba-ssm-dtype float32 -> bfloat16", hit[1])

    # a smaller DDTree budget narrows the scratch rows (down to the drafter block); an adaptive server
    # first drops its widest widths (the widest sizes the window), keeping the narrower ones
    if r is not None and r.decoder.adaptive:
        hit = _first_fit(settings, [{"speculative-ddtree-budget": v} for v in _narrower(r.decoder.widths)],
                         replan)  # fmt: skip
        if hit:
            now = hit[0]["speculative-ddtree-budget"]
            yield Change(hit[0], f"speculative-ddtree-budget {r.decoder.shown} -> {now}", hit[1])
    elif r is not None and r.budget > 1:
        hit = _largest_fit(settings, 1, r.budget - 1, lambda b: {"speculative-ddtree-budget": b}, replan)
        if hit:
            yield Change(
                hit[0],
                f"speculative-ddtree-budget {r.budget} -> {hit[0]['speculative-ddtree-budget']}",
                hit[1],
            )

    # more GPUs per server (fewer, when the host has fewer than the profile asks for)
    tp = settings.tp_size
    wider = [{"tp-size": t} for t in (2, 4, 8) if tp < t <= len(plan.gpus)]
    if plan.verdict.term == "gpus":
        wider = [{"tp-size": t} for t in (4, 2, 1) if t < tp and t <= len(plan.gpus)]
    hit = _first_fit(settings, wider, replan)
    if hit:
        yield Change(hit[0], f"tp-size {tp} -> {hit[0]['tp-size']}", hit[1])

    # a shorter context, when the pool holds less than one full request
    if plan.verdict.status == "smaller_context" and plan.verdict.max_context:
        top = max(1024, plan.verdict.max_context // 1024 * 1024)
        hit = _largest_fit(settings, 1, top // 1024, lambda k: {"context-length": k * 1024}, replan)
        if hit:
            yield Change(
                hit[0],
                f"context-length {r.context_length if r else '?'} -> {hit[0]['context-length']}",
                hit[1],
            )

    # a smaller prefill chunk needs fewer activations
    if plan.verdict.term == "activations" and r is not None and r.chunked_prefill_size > 512:
        sizes = [r.chunked_prefill_size // 2**i for i in range(1, 4) if r.chunked_prefill_size // 2**i >= 512]
        hit = _first_fit(settings, [{"chunked-prefill-size": c} for c in sizes], replan)
        if hit:
            yield Change(
                hit[0],
                f"chunked-prefill-size {r.chunked_prefill_size} -> {hit[0]['chunked-prefill-size']}",
                hit[1],
            )


def _narrower(widths: tuple[int, ...]) -> list[int | str]:
    """An adaptive server's widths with the widest dropped, one more each time, as the flag spells them:
    ``15,23,31`` -> ``15,23``, then ``15`` (one width)."""
    return [",".join(map(str, widths[:n])) if n > 1 else widths[0] for n in range(len(widths) - 1, 0, -1)]


def _steps(settings: ServeSettings, plan: Plan) -> Iterator[tuple[dict[str, Any], str]]:
    """First moves for combinations: those that free the most memory without costing requests."""
    r = plan.resolved
    moves: list[tuple[dict[str, Any], str]] = []
    if plan.pair.target.hybrid and r is not None and r.ssm_dtype == "float32":
        moves.append(({"mamba-ssm-dtype": "bfloat16"}, "mamba-ssm-dtype float32 -> bfloat16"))
    for t in (2, 4, 8):
        if settings.tp_size < t <= len(plan.gpus):
            moves.append(({"tp-size": t}, f"tp-size {settings.tp_size} -> {t}"))
            break
    yield from moves
    if len(moves) == 2:
        yield {**moves[0][0], **moves[1][0]}, f"{moves[0][1]}, {moves[1][1]}"
