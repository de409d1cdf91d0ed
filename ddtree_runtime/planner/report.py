"""A plan as the operator reads it (a table) and as tools read it (one JSON object)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddtree_runtime.planner.tensor_parallel import tensor_parallel

if TYPE_CHECKING:
    from ddtree_runtime.planner.accounting import Plan
    from ddtree_runtime.planner.fixes import Change

# Terms drawn from the static pool / the run-time headroom are indented under them.
_UNDER_STATIC = (
    "target_weights",
    "draft_weights",
    "mm_reserve",
    "speculative_scratch",
    "recurrent_state",
    "kv_cache",
)
_UNDER_HEADROOM = ("activations",)
_STATUS = {
    "fits": "FITS",
    "does_not_fit": "DOES NOT FIT",
    "smaller_context": "FITS ONLY WITH A SMALLER CONTEXT",
}


def _gpu_line(plan: Plan) -> str:
    names: dict[str, int] = {}
    for g in plan.gpus:
        names[f"{g.name} ({g.total_gib:.1f} GiB)"] = names.get(f"{g.name} ({g.total_gib:.1f} GiB)", 0) + 1
    have = ", ".join(f"{n} x {name}" for name, n in names.items())
    used = ",".join(str(g.index) for g in plan.used) or "-"
    return f"{have}; tp-size {plan.settings.tp_size} -> GPU {used}"


def _settings_line(plan: Plan) -> str:
    r = plan.resolved
    if r is None:
        return f"tp-size {plan.settings.tp_size}"
    if r.decoder.adaptive:
        verify = " or ".join(str(b + 1) for b in r.decoder.widths)
        budget = (f"budget {r.decoder.shown} (adaptive: verify {verify} tokens a round, {r.draft_tokens} "
                  "reserved per request for the widest)")  # fmt: skip
    else:
        budget = f"budget {r.budget} (verify {r.verify_width} tokens, {r.draft_tokens} reserved per request)"
    parts = [
        budget,
        f"max-running-requests {r.requested_running}",
        f"context {r.context_length:,}",
    ]
    if plan.pair.target.hybrid:
        radix = r.radix_strategy or "off"
        parts.append(f"SSM {r.ssm_dtype}, radix {radix} ({r.mamba_ratio} state slots per request)")
    parts.append("overlap on" if r.overlap else "overlap off")
    parts.append("CUDA graphs on" if r.cuda_graphs else "CUDA graphs off")
    return ", ".join(parts)


def format_plan(
    plan: Plan,
    changes: list[Change] | None = None,
    *,
    title: str | None = None,
    sources: bool = False,
    fitting: list[str] | None = None,
) -> str:
    t, d = plan.pair.target, plan.pair.draft
    kind = (
        f"{len(t.linear.layers)} GDN + {len(t.full_attention_layers)} full-attention layers"
        if t.linear is not None
        else f"{t.num_layers} attention layers"
    )
    head = title or f"ddtree plan: profile {plan.profile or '(flags)'}"
    lines = [
        head,
        f"  target   {t.path}: {t.architecture}, {kind}, {t.dtype}",
        f"  drafter  {d.path}: {d.num_layers} layers, block {d.block_size}",
        f"  GPUs     {_gpu_line(plan)}",
        f"  settings {_settings_line(plan)}",
    ]
    if plan.settings.ignored:
        lines.append(f"  (flags that do not size memory: {', '.join(plan.settings.ignored)})")
    if plan.terms:
        lines.append("")
        lines.append(f"  {'per GPU':<46}{'GiB':>8}")
        for term in plan.terms:
            indent = "    " if term.key in _UNDER_STATIC + _UNDER_HEADROOM else "  "
            sign = "- " if term.key == "context" else ("= " if term.key == "pre_load" else "")
            label = f"{indent}{sign}{term.label}" + (" (estimate)" if term.estimate else "")
            detail = term.detail + (f" [{term.source}]" if sources and term.source else "")
            lines.append(f"{label:<48}{term.gib:>8.2f}  {detail}".rstrip())
        lines.append("")
    if plan.resolved is not None and plan.token_capacity:
        r = plan.resolved
        lines.append(
            f"  capacity: {plan.token_capacity:,} KV tokens = {plan.token_capacity / r.context_length:.1f} x "
            f"context-length {r.context_length:,}; running requests {plan.running_requests}"
            f" (profile asks {r.requested_running})"
        )
    for note in plan.notes:
        lines.append(f"  note: {note}")
    tp = tensor_parallel(plan)
    if tp is not None:
        lines.extend(tp.lines())
    v = plan.verdict
    status = _STATUS[v.status]
    if v.status == "fits":
        lines.append(f"  verdict: {status}")
    else:
        term = plan.term(v.term) if v.term else None
        what = term.label if term else (v.term or "")
        by = f" by {v.short_gib:.2f} GiB" if v.short_gib else ""
        lines.append(f"  verdict: {status}: {what}{by}")
        lines.append(f"    {v.message}")
    if changes:
        lines.append("  smallest changes that fit:")
        for i, change in enumerate(changes, 1):
            p = change.plan
            lines.append(
                f"    {i}. {change.summary}: {p.token_capacity:,} KV tokens, {p.running_requests} running"
            )
    elif changes is not None and not v.fits:
        lines.append("  no change of one or two knobs makes it fit: this model needs bigger or more GPUs")
    if fitting:
        lines.append(f"  shipped profiles that fit here as they are: {', '.join(fitting)}")
    return "\n".join(lines)


def plan_to_dict(plan: Plan, changes: list[Change] | None = None) -> dict[str, Any]:
    r = plan.resolved
    t, d = plan.pair.target, plan.pair.draft
    return {
        "profile": plan.profile,
        "verdict": {
            "status": plan.verdict.status,
            "fits": plan.verdict.fits,
            "term": plan.verdict.term,
            "short_gib": round(plan.verdict.short_gib, 3),
            "message": plan.verdict.message,
            "max_context": plan.verdict.max_context,
        },
        "target": {
            "path": t.path,
            "architecture": t.architecture,
            "hybrid": t.hybrid,
            "layers": t.num_layers,
            "full_attention_layers": len(t.full_attention_layers),
            "linear_layers": len(t.linear.layers) if t.linear else 0,
            "dtype": t.dtype,
            "weights_bytes": t.weights.total,
            "weights_skipped_bytes": t.weights.skipped_bytes,
        },
        "draft": {
            "path": d.path,
            "layers": d.num_layers,
            "block_size": d.block_size,
            "weights_bytes": d.weights.total,
        },
        "gpus": [g.to_dict() for g in plan.gpus],
        "used_gpus": [g.index for g in plan.used],
        "settings": plan.settings.to_dict(),
        "resolved": None
        if r is None
        else {
            "tp_size": r.tp,
            "context_length": r.context_length,
            "max_running_requests": r.requested_running,
            "budget": r.budget,
            "widths": list(r.decoder.widths),  # adaptive: every width it may verify ([]: one, the budget)
            "block_size": r.block_size,
            "verify_width": r.verify_width,
            "speculative_num_draft_tokens": r.draft_tokens,
            "overlap": r.overlap,
            "mamba_radix_cache_strategy": r.radix_strategy,
            "mamba_ratio": r.mamba_ratio,
            "mamba_ssm_dtype": r.ssm_dtype,
            "kv_cache_dtype": r.kv_dtype,
            "cuda_graphs": r.cuda_graphs,
            "cuda_graph_max_bs_decode": r.cuda_graph_max_bs,
            "chunked_prefill_size": r.chunked_prefill_size,
            "mem_fraction_static": round(r.mem_fraction_static, 4),
            "mem_fraction_auto": r.mem_fraction_auto,
        },
        "terms": [{**term.to_dict(), "gib": round(term.gib, 4)} for term in plan.terms],
        "token_capacity": plan.token_capacity,
        "running_requests": plan.running_requests,
        "mamba_slots": plan.mamba_slots,
        "notes": list(plan.notes),
        "tensor_parallel": None if (tp := tensor_parallel(plan)) is None else tp.to_dict(),
        "changes": [c.to_dict() for c in changes or []],
    }
