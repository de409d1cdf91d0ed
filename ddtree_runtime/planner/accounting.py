"""Per-GPU memory terms of an SGLang 0.5.23 start-up, in the order SGLang takes them, and the verdict.

What each TP rank does at start (all ranks alike; SGLang takes the smallest free memory of them):

1. ``distributed/bootstrap.measure_pre_model_load_memory``: free memory after the CUDA context
   and NCCL are up (``pre``).
2. ``ModelRunner.load_model``: target and drafter weights (this rank's share).
3. ``KVCacheConfigurator._profile_available_bytes``: the pools get ``free_after_load -
   pre * (1 - mem_fraction_static) - mm_runtime_reservation_gb``; the rest, ``pre * (1 -
   mem_fraction_static)``, is the run-time headroom for activations and CUDA graphs.
4. Hybrid targets, ``KVCacheConfigurator._handle_max_mamba_cache``: the speculative scratch
   (``intermediate_ssm`` + ``intermediate_conv_window``, ``MambaPool.__init__``) for
   ``min(max_running_requests, max_mamba_cache_size // ratio) + 1`` rows of
   ``speculative_num_draft_tokens`` each, then ``max_mamba_cache_size + 1`` recurrent-state slots.
5. ``DefaultPoolConfigurator.calculate_pool_sizes``: what is left, over the KV bytes per token of
   the target's full-attention layers plus the drafter's layers
   (``scale_kv_cell_size_per_token_for_dflash``), is the token capacity (``MemoryPoolConfig`` raises
   "Not enough memory" at zero).
6. ``KVCacheConfigurator.resolve_max_num_reqs``: running requests, capped by the tokens and by the
   mamba state slots.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ddtree_runtime.planner import gpus as gpu_facts
from ddtree_runtime.planner.gpus import GpuFacts
from ddtree_runtime.planner.settings import Resolved, ServeSettings, activation_reserve_mib, resolve
from ddtree_runtime.planner.shapes import DTYPE_BYTES, ModelPair, PlanError

GIB = 1 << 30
MIB = 1 << 20
# CUDA context (+ NCCL communicators with TP) that exist before SGLang measures `pre`: an estimate,
# SGLang measures it. Seen on Hopper: ~0.5 GiB per process, ~1 GiB with NCCL.
CONTEXT_GIB = {1: 0.6}
CONTEXT_GIB_TP = 1.1
# envs.SGLANG_VLM_CACHE_SIZE_MB (multimodal embedding cache, reserved out of the KV budget).
VLM_CACHE_MIB = 100

__all__ = ["GIB", "Plan", "PlanError", "Term", "Verdict", "plan_memory"]


@dataclass(frozen=True)
class Term:
    key: str
    label: str
    gib: float
    detail: str = ""
    source: str = ""
    estimate: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Verdict:
    status: str  # fits | does_not_fit | smaller_context
    term: str | None = None  # the term that does not fit
    short_gib: float = 0.0  # by how much
    message: str = ""
    max_context: int | None = None  # for smaller_context: the longest request the pool holds

    @property
    def fits(self) -> bool:
        return self.status == "fits"


@dataclass(frozen=True)
class Plan:
    profile: str | None
    pair: ModelPair
    settings: ServeSettings
    resolved: Resolved | None
    gpus: tuple[GpuFacts, ...]  # every GPU of the host
    used: tuple[GpuFacts, ...]  # the GPUs the TP ranks land on
    terms: tuple[Term, ...]
    verdict: Verdict
    token_capacity: int = 0
    running_requests: int = 0
    mamba_slots: int = 0
    notes: tuple[str, ...] = field(default=())

    def term(self, key: str) -> Term | None:
        return next((t for t in self.terms if t.key == key), None)


def _gib(nbytes: float) -> float:
    return nbytes / GIB


def plan_memory(
    pair: ModelPair,
    gpus: list[GpuFacts],
    settings: ServeSettings,
    *,
    profile: str | None = None,
    visible: list[int] | None = None,
    claimed_gib: dict[int, float] | None = None,
    notes: tuple[str, ...] = (),
) -> Plan:
    """Plan one server on ``gpus``.

    ``claimed_gib``: memory another server (the live one, when planning a shadow) claims, per GPU index.
    """
    tp = settings.tp_size
    notes = list(notes)
    if pair.target.linear is not None:
        pair.target.linear.check_tp(tp)
    try:
        used = gpu_facts.select(
            gpus, tp=tp, base_gpu_id=settings.base_gpu_id, gpu_id_step=settings.gpu_id_step, visible=visible
        )
    except PlanError as exc:
        verdict = Verdict("does_not_fit", "gpus", 0.0, str(exc))
        return Plan(profile, pair, settings, None, tuple(gpus), (), (), verdict)
    claimed_gib = claimed_gib or {}
    free_per_gpu = [min(g.free_gib, g.total_gib - claimed_gib.get(g.index, 0.0)) for g in used]
    free = max(0.0, min(free_per_gpu))
    r = resolve(settings, pair, gpu_mem_mib=min(g.total_mib for g in used))
    if r.decoder.adaptive:
        notes.append(adaptive_note(r))
    target, draft = pair.target, pair.draft
    terms: list[Term] = []

    def add(
        key: str, label: str, gib: float, detail: str = "", source: str = "", estimate: bool = False
    ) -> None:
        terms.append(Term(key, label, gib, detail, source, estimate))

    lowest = min(range(len(used)), key=lambda i: free_per_gpu[i])
    where = "nvidia-smi" if used[lowest].source == "nvidia-smi" else used[lowest].source
    if claimed_gib and any(claimed_gib.get(g.index) for g in used):
        where += ", less what the live service claims"
    add("free", f"free on GPU {used[lowest].index} ({used[lowest].name})", free, where)
    context = CONTEXT_GIB.get(tp, CONTEXT_GIB_TP)
    add("context", "CUDA context" + (" + NCCL" if tp > 1 else ""), context, "per process", estimate=True)
    pre = max(0.0, free - context)
    add("pre_load", "available before the model loads", pre, "", "bootstrap.measure_pre_model_load_memory")
    f = r.mem_fraction_static
    static = pre * f
    headroom = pre - static
    fraction_note = "SGLang's own default" if r.mem_fraction_auto else "profile"
    add(
        "static",
        f"static pools at mem-fraction-static {f:.3f}",
        static,
        fraction_note,
        "KVCacheConfigurator._profile_available_bytes",
    )
    t_w = target.weights.per_rank(tp)
    d_w = draft.weights.per_rank(tp)
    tp_note = f"1/{tp} of >=2-D tensors + 1-D ones" if tp > 1 else "all of it"
    skipped = (
        f"; {target.weights.skipped_bytes / GIB:.2f} GiB not loaded ({', '.join(target.weights.skipped)})"
        if target.weights.skipped_bytes
        else ""
    )
    add(
        "target_weights",
        "target weights",
        _gib(t_w),
        f"{tp_note}, {target.dtype}{skipped}",
        "ModelRunner.load_model",
    )
    add("draft_weights", "drafter weights", _gib(d_w), tp_note, "ModelRunner.load_model")
    mm = VLM_CACHE_MIB / 1024 if target.multimodal else 0.0
    if mm:
        add(
            "mm_reserve",
            "multimodal embedding cache",
            mm,
            "SGLANG_VLM_CACHE_SIZE_MB",
            "mm_runtime_reservation_gb",
        )
    weights = _gib(t_w + d_w)
    rest = (pre - weights) - headroom - mm

    def done(verdict: Verdict, **kw: Any) -> Plan:
        reserve = activation_reserve_mib(r, settings) / 1024
        terms.append(
            Term("headroom", f"run-time headroom (1 - {f:.3f})", headroom, "", "mem_fraction_static")
        )
        terms.append(
            Term(
                "activations",
                "CUDA graphs + activations",
                reserve,
                f"chunked prefill {r.chunked_prefill_size}, "
                + (
                    f"decode graphs up to batch {r.cuda_graph_max_bs}" if r.cuda_graphs else "CUDA graphs off"
                ),
                "memory_hook.handle_gpu_memory_settings",
                estimate=True,
            )
        )
        return Plan(
            profile,
            pair,
            settings,
            r,
            tuple(gpus),
            tuple(used),
            tuple(terms),
            verdict,
            notes=tuple(notes),
            **kw,
        )

    if pre <= 0:
        held = " (what the live service holds is taken off)" if claimed_gib else ""
        return done(
            Verdict(
                "does_not_fit",
                "free",
                context - free,
                f"GPU {used[lowest].index} has {free:.2f} GiB free{held}, less than the CUDA context "
                "alone needs: the server cannot start there",
            )
        )
    if weights + mm >= pre:
        return done(
            Verdict(
                "does_not_fit",
                "target_weights",
                weights + mm - pre,
                f"the weights ({weights:.1f} GiB per GPU) do not fit in the {pre:.1f} GiB the GPU "
                "has: loading fails with CUDA out of memory",
            )
        )
    if rest <= 0:
        return done(
            Verdict(
                "does_not_fit",
                "target_weights",
                -rest,
                f"the weights ({weights:.1f} GiB) leave nothing of the static pool "
                f"({static:.1f} GiB at mem-fraction-static {f:.3f}): SGLang raises "
                "'Loaded weights leave no GPU memory for the KV cache'",
            )
        )

    slots = 0
    running = r.requested_running
    if target.linear is not None:
        per_slot = target.linear.state_bytes_per_slot(tp, ssm_bytes=DTYPE_BYTES[r.ssm_dtype])
        mamba = _mamba(rest, per_slot, r, settings)
        slots, rows = mamba["slots"], mamba["rows"]
        d = r.draft_tokens
        add(
            "speculative_scratch",
            "speculative scratch",
            _gib(mamba["scratch"]),
            f"{rows} rows (running {rows - 1} + 1) x {d} tokens x {per_slot / MIB:.1f} MiB "
            f"(S = max(budget {r.budget} + 1, block {r.block_size}))",
            "_handle_max_mamba_cache; MambaPool intermediate_ssm/conv_window",
        )
        add(
            "recurrent_state",
            "recurrent state",
            _gib(mamba["state"]) if slots > 0 else 0.0,
            f"{max(slots, 0)} slots + 1 x {per_slot / MIB:.1f} MiB ({len(target.linear.layers)} GDN layers, "
            f"SSM {r.ssm_dtype}, conv bfloat16; {r.mamba_ratio} slots per request, radix {r.radix_strategy})",
            "_handle_max_mamba_cache; BaseLinearStateParams.mamba_cache_per_req",
        )
        if slots <= 0 or mamba["rest"] <= 0:
            need = mamba["scratch"] + max(slots + 1, 2) * per_slot
            short = _gib(need) - max(rest, 0.0)
            key = (
                "speculative_scratch"
                if mamba["scratch"] >= max(slots + 1, 2) * per_slot
                else "recurrent_state"
            )
            msg = (
                f"the speculative scratch ({_gib(mamba['scratch']):.1f} GiB) and the recurrent state "
                f"need {_gib(need):.1f} GiB; {max(rest, 0.0):.1f} GiB of the static pool is left after the "
                "weights"
            )
            if slots <= 0:
                msg += (
                    ": SGLang raises 'Not enough GPU memory for hybrid (mamba/linear-attention) state cache'"
                )
            else:
                msg += ": SGLang raises 'Loaded weights leave no GPU memory for the KV cache'"
            return done(Verdict("does_not_fit", key, max(short, 0.0), msg), mamba_slots=max(slots, 0))
        rest = mamba["rest"]
        cap = slots // r.mamba_ratio
        if cap < running:
            notes.append(
                f"max-running-requests {running} is capped to {cap} by the recurrent state "
                f"({slots} slots / {r.mamba_ratio} per request), as SGLang's resolve_max_num_reqs does"
            )
        running = min(running, cap)

    kv_bytes = DTYPE_BYTES[r.kv_dtype]
    t_cell = target.kv_bytes_per_token(tp, kv_bytes)
    d_cell = draft.kv_bytes_per_token(tp, kv_bytes)
    cell = t_cell + d_cell
    budget_bytes = int(rest * GIB)
    tokens = budget_bytes // cell // r.page_size * r.page_size
    add(
        "kv_cache",
        "KV cache",
        _gib(tokens * cell),
        f"{tokens:,} tokens x {cell / 1024:.1f} KiB (target {t_cell / 1024:.1f} KiB: "
        f"{len(target.full_attention_layers)} full-attention layers x "
        f"{target.kv_heads_per_rank(tp)} KV heads; "
        f"drafter {d_cell / 1024:.1f} KiB: {draft.num_layers} layers)",
        "DefaultPoolConfigurator.calculate_pool_sizes",
    )
    if tokens <= 0:
        short = _gib(cell * r.context_length) - max(rest, 0.0)
        return done(
            Verdict(
                "does_not_fit",
                "kv_cache",
                max(short, 0.0),
                f"no memory is left for the KV cache ({rest:.2f} GiB after the weights"
                + (" and the mamba pools" if target.hybrid else "")
                + "): SGLang raises 'Not enough "
                "memory. Please try to increase --mem-fraction-static'",
            ),
            mamba_slots=slots,
        )
    running = min(running, tokens // 2)
    if target.hybrid and running <= 0:
        return done(
            Verdict(
                "does_not_fit",
                "recurrent_state",
                _gib(per_slot * r.mamba_ratio),
                f"max-mamba-cache-size {slots} holds no request at {r.mamba_ratio} slots each: SGLang "
                "raises 'Hybrid (mamba/linear-attention) state cache is too small to serve any "
                "requests'",
            ),
            token_capacity=tokens,
            mamba_slots=slots,
        )
    reserve = activation_reserve_mib(r, settings) / 1024
    common = {"token_capacity": tokens, "running_requests": running, "mamba_slots": slots}
    if headroom < reserve:
        return done(
            Verdict(
                "does_not_fit",
                "activations",
                reserve - headroom,
                f"mem-fraction-static {f:.3f} leaves {headroom:.1f} GiB for CUDA graphs and "
                f"activations; SGLang's own estimate for them is {reserve:.1f} GiB (an estimate: "
                "expect CUDA out of memory at graph capture or under load)",
            ),
            **common,
        )
    if tokens < r.context_length:
        return done(
            Verdict(
                "smaller_context",
                "kv_cache",
                _gib((r.context_length - tokens) * cell),
                f"the KV cache holds {tokens:,} tokens, less than one request of context-length "
                f"{r.context_length:,}: longer requests are refused",
                max_context=tokens,
            ),
            **common,
        )
    full = tokens // r.context_length
    if full < running:
        notes.append(
            f"{tokens:,} tokens hold {full} full-context request(s) at once; {running} running "
            f"requests average {tokens // running:,} tokens each"
        )
    return done(Verdict("fits", message=f"fits: {tokens:,} KV tokens, {running} running requests"), **common)


def adaptive_note(r: Resolved) -> str:
    """What the plan counts for an adaptive server, and what it does not: the window and the scratch are
    the widest width's; the CUDA-graph term is SGLang's own estimate (2 MiB per captured batch size,
    ``graph_reserve_mib``), which does not depend on the width, so whatever graphs an extra width captures
    are not counted (the plugin captures the target verify for the widest width only, for now)."""
    d = r.decoder
    return (f"adaptive widths {d.shown}: the KV window and speculative scratch are sized for the widest "
            f"({r.draft_tokens} rows per request); the CUDA-graph estimate is SGLang's and does not grow "
            f"with the {len(d.widths)} widths")  # fmt: skip


def _mamba(rest_gib: float, per_slot: int, r: Resolved, settings: ServeSettings) -> dict[str, Any]:
    """``KVCacheConfigurator._handle_max_mamba_cache`` (speculative decoding on, no PP, no ReplaySSM)."""
    d = r.draft_tokens
    running = max(1, r.requested_running)
    if settings.max_mamba_cache_size is not None:
        slots = settings.max_mamba_cache_size
        capped = min(running, slots // r.mamba_ratio)
    elif r.radix_strategy is None:  # radix cache off: one slot per running request
        slots = running
        capped = slots
    else:  # joint solve of state slots and scratch inside mamba_full_memory_ratio of the rest
        ratio = settings.mamba_full_memory_ratio
        budget = rest_gib * ratio / (1 + ratio) * GIB
        slots = int((budget - per_slot * (1 + d)) // (per_slot * (1 + d / r.mamba_ratio)))
        capped = min(running, slots // r.mamba_ratio)
    scratch = per_slot * (capped + 1) * d
    rest = rest_gib - _gib(scratch)
    state = (slots + 1) * per_slot
    if slots > 0:
        rest -= _gib(state)
    return {"slots": slots, "rows": capped + 1, "scratch": scratch, "state": state, "rest": rest}
