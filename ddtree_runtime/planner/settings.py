"""A profile's flags (SGLang 0.5.23 spelling, as in profiles.yml) and what SGLang resolves them to.

The resolution mirrors the pinned release for the knobs that size memory: DFLASH's defaults
(``arg_groups/speculative_hook._handle_dflash``: 48 running requests), DDTREE's widths (the decoder
settings' one rule, ``core/decoder_settings.DecoderSettings``, which the plugin's
``algorithm.resolve_server_args`` applies too: verify width budget + 1, per-request reservation
max(budget + 1, block), the default budget block - 1; ``auto`` or a list of widths reserves for the
widest), the overlap scheduler (on for trees and the chain unless disabled), the mamba radix strategy
(``arg_groups/overrides._mamba_radix_cache_resolution``) and the GPU-size defaults
(``arg_groups/memory_hook.handle_gpu_memory_settings``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ddtree_runtime.core.decoder_settings import (
    AUTO,
    MAX_BLOCK_SIZE,
    MAX_BUDGET,
    MIN_BLOCK_SIZE,
    DecoderSettings,
    SettingsError,
    parse_budget,
)
from ddtree_runtime.planner.shapes import DTYPE_BYTES, ModelPair, PlanError

DFLASH_DEFAULT_MAX_RUNNING = 48
DEFAULT_MAX_PREFILL_TOKENS = 16384
# The flags the planner reads; every other profile flag is listed as not affecting the plan.
BUDGET_FLAG = "speculative-ddtree-budget"  # a number, "auto" or a comma list of widths: _budget_value
_INT_FLAGS = {
    "tp-size": "tp_size", "context-length": "context_length", "max-running-requests": "max_running_requests",
    BUDGET_FLAG: "budget", "speculative-dflash-block-size": "block_size",
    "speculative-ddtree-topk-cap": "topk_cap", "max-mamba-cache-size": "max_mamba_cache_size",
    "cuda-graph-max-bs-decode": "cuda_graph_max_bs", "chunked-prefill-size": "chunked_prefill_size",
    "page-size": "page_size", "base-gpu-id": "base_gpu_id", "gpu-id-step": "gpu_id_step",
    "max-prefill-tokens": "max_prefill_tokens",
}  # fmt: skip
_FLOAT_FLAGS = {
    "mem-fraction-static": "mem_fraction_static",
    "mamba-full-memory-ratio": "mamba_full_memory_ratio",
}
_STR_FLAGS = {
    "mamba-ssm-dtype": "mamba_ssm_dtype",
    "mamba-radix-cache-strategy": "radix_strategy",
    "kv-cache-dtype": "kv_cache_dtype",
}
_BOOL_FLAGS = {
    "disable-cuda-graph": "disable_cuda_graph",
    "disable-radix-cache": "disable_radix_cache",
    "disable-overlap-schedule": "disable_overlap_schedule",
}
ALIASES = {"tensor-parallel-size": "tp-size", "tp": "tp-size"}


@dataclass(frozen=True)
class ServeSettings:
    """The memory-relevant launch flags (None = SGLang's default)."""

    tp_size: int = 1
    mem_fraction_static: float | None = None
    context_length: int | None = None
    max_running_requests: int | None = None
    # The budget flag as the profile spells it, normalised: a number, "auto" or the widths "15,31"
    # (adaptive: the widest sizes the window); resolved against the drafter's block in resolve().
    budget: int | str | None = None
    block_size: int | None = None
    topk_cap: int | None = None
    mamba_ssm_dtype: str | None = None
    max_mamba_cache_size: int | None = None
    mamba_full_memory_ratio: float = 0.9
    radix_strategy: str = "auto"
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    chunked_prefill_size: int | None = None
    max_prefill_tokens: int | None = None
    kv_cache_dtype: str = "auto"
    page_size: int | None = None
    base_gpu_id: int = 0
    gpu_id_step: int = 1
    ignored: tuple[str, ...] = field(default=(), compare=False)

    def with_flag(self, flag: str, value: Any) -> ServeSettings:
        return from_flags({**to_flags(self), flag: value})

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ignored"] = list(self.ignored)
        return out


def from_flags(flags: dict[str, Any] | None) -> ServeSettings:
    """Settings from ``{flag: value}`` (profiles.yml ``flags``; ``--`` prefixes and ``_`` spellings taken)."""
    values: dict[str, Any] = {}
    ignored = []
    for raw, value in (flags or {}).items():
        flag = str(raw).lstrip("-").replace("_", "-")
        flag = ALIASES.get(flag, flag)
        if value is None or (value is False and flag not in _BOOL_FLAGS):
            continue
        try:
            if flag == BUDGET_FLAG:
                values["budget"] = _budget_value(value)
            elif flag in _INT_FLAGS:
                values[_INT_FLAGS[flag]] = _as_int(flag, value)
            elif flag in _FLOAT_FLAGS:
                values[_FLOAT_FLAGS[flag]] = float(value)
            elif flag in _STR_FLAGS:
                values[_STR_FLAGS[flag]] = str(value)
            elif flag in _BOOL_FLAGS:
                values[_BOOL_FLAGS[flag]] = value is True or str(value).lower() in ("true", "1", "yes")
            else:
                ignored.append(flag)
        except PlanError:
            raise
        except (TypeError, ValueError):
            raise PlanError(f"--{flag} takes a number, got {value!r}") from None
    settings = ServeSettings(**values, ignored=tuple(sorted(ignored)))
    _check(settings)
    return settings


def to_flags(settings: ServeSettings) -> dict[str, Any]:
    """The inverse of :func:`from_flags` (only what differs from SGLang's defaults)."""
    default = ServeSettings()
    out: dict[str, Any] = {}
    for table in (_INT_FLAGS, _FLOAT_FLAGS, _STR_FLAGS, _BOOL_FLAGS):
        for flag, attr in table.items():
            value = getattr(settings, attr)
            if value != getattr(default, attr):
                out[flag] = value
    return out


def _budget_value(value: Any) -> int | str:
    """The budget flag's three spellings (``core/decoder_settings.parse_budget``): a number (one width),
    ``auto``, or a comma list of 2..MAX_WIDTHS widths, kept as the flag's text (``15,31``, sorted).
    PlanError naming the flag, the value and what it takes."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return _as_int(BUDGET_FLAG, value)
    try:
        spec = parse_budget(value, what=f"--{BUDGET_FLAG}")
    except SettingsError as exc:
        raise PlanError(str(exc)) from None
    return ",".join(str(b) for b in spec) if isinstance(spec, tuple) else spec


def _budgets(value: int | str | None) -> list[int]:
    """The budgets a settled flag value names (none for ``auto``: they follow the drafter's block)."""
    if value is None or value == AUTO:
        return []
    return [value] if isinstance(value, int) else [int(b) for b in value.split(",")]


def _as_int(flag: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(flag)
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(flag)
    return int(value)


# The plausible range of each count (low, high): beyond it a flag is a typo or absurd, and the planner's
# searches and tables would grow with it, so it is refused (exit 2) rather than planned. The budget and the
# drafter block take the decoder settings' limits: a budget the plugin refuses is not planned.
LIMITS = {
    "tp_size": (1, 64), "context_length": (1, 1 << 26), "max_running_requests": (1, 1 << 16),
    "budget": (1, MAX_BUDGET), "block_size": (MIN_BLOCK_SIZE, MAX_BLOCK_SIZE), "topk_cap": (1, 1 << 20),
    "cuda_graph_max_bs": (1, 4096),
    "page_size": (1, 4096), "gpu_id_step": (1, 64), "base_gpu_id": (0, 63),
    "max_mamba_cache_size": (0, 1 << 20), "chunked_prefill_size": (-1, 1 << 22),
    "max_prefill_tokens": (1, 1 << 24),
}  # fmt: skip


def _check(s: ServeSettings) -> None:
    problems = []
    if s.mem_fraction_static is not None and not 0 < s.mem_fraction_static < 1:
        problems.append(f"mem-fraction-static must be between 0 and 1, got {s.mem_fraction_static}")
    if not 0 < s.mamba_full_memory_ratio <= 100:
        problems.append(f"mamba-full-memory-ratio must be in (0, 100], got {s.mamba_full_memory_ratio}")
    for name, (low, high) in LIMITS.items():
        value = getattr(s, name)
        if name == "budget":
            bad = [b for b in _budgets(value) if not low <= b <= high]
            if bad:
                listed = "" if isinstance(value, int) else f" (in {value})"
                problems.append(f"budget must be in {low}..{high}, got {bad[0]}{listed}")
        elif value is not None and not low <= value <= high:
            problems.append(f"{name.replace('_', '-')} must be in {low}..{high}, got {value}")
    if s.mamba_ssm_dtype is not None and s.mamba_ssm_dtype not in DTYPE_BYTES:
        problems.append(f"mamba-ssm-dtype must be one of {', '.join(DTYPE_BYTES)}, got {s.mamba_ssm_dtype!r}")
    if s.radix_strategy not in ("auto", "no_buffer", "extra_buffer", "extra_buffer_lazy"):
        problems.append(f"unknown mamba-radix-cache-strategy {s.radix_strategy!r}")
    if problems:
        raise PlanError("; ".join(problems))


# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resolved:
    """What SGLang resolves the settings to for this model pair on this GPU."""

    tp: int
    context_length: int
    requested_running: int
    decoder: DecoderSettings  # budget, drafter block, top-K cap: the plugin's resolution
    overlap: bool
    radix_strategy: str | None  # None: no mamba radix cache
    mamba_ratio: int  # state slots per running request (_calculate_mamba_ratio)
    ssm_dtype: str
    kv_dtype: str
    page_size: int
    cuda_graphs: bool
    cuda_graph_max_bs: int
    chunked_prefill_size: int
    mem_fraction_static: float
    mem_fraction_auto: bool
    gpu_mem_mib: int

    @property
    def budget(self) -> int:
        """The widest verify budget (an adaptive server's widest width sizes its window and scratch)."""
        return self.decoder.budget

    @property
    def block_size(self) -> int:
        return self.decoder.block_size

    @property
    def verify_width(self) -> int:
        """Tokens per request in each target verify (budget + 1)."""
        return self.decoder.verify_rows

    @property
    def draft_tokens(self) -> int:
        """``speculative_num_draft_tokens``: the per-request reservation, max(budget + 1, block)."""
        return self.decoder.kv_window


def resolve(settings: ServeSettings, pair: ModelPair, gpu_mem_mib: int) -> Resolved:
    target, draft = pair.target, pair.draft
    block = settings.block_size or draft.block_size
    if block < 2:
        raise PlanError(f"the drafter block must be at least 2 (got {block})")
    try:
        decoder = DecoderSettings.resolve(settings.budget, block, settings.topk_cap)
    except SettingsError as exc:
        raise PlanError(str(exc)) from None
    # Trees and the chain alike keep SGLang's overlap scheduler unless disabled (the plugin's resolution).
    overlap = not settings.disable_overlap_schedule
    context = settings.context_length or target.context_length
    running = settings.max_running_requests or DFLASH_DEFAULT_MAX_RUNNING
    radix = None
    ratio = 1
    if target.hybrid and not settings.disable_radix_cache:
        radix = settings.radix_strategy
        if radix == "auto":  # _mamba_radix_cache_resolution
            radix = "extra_buffer" if overlap or (settings.page_size or 1) > 1 else "no_buffer"
        # KVCacheConfigurator._calculate_mamba_ratio (SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK off)
        ratio = 3 + {"no_buffer": 0, "extra_buffer": 2 if overlap else 1, "extra_buffer_lazy": 1}[radix]
    ssm = settings.mamba_ssm_dtype or target.config_ssm_dtype or "float32"  # mamba_utils.mamba2_state_dtype
    if ssm not in DTYPE_BYTES:
        raise PlanError(f"the target config's mamba_ssm_dtype {ssm!r} is not one of {', '.join(DTYPE_BYTES)}")
    kv = target.dtype if settings.kv_cache_dtype in ("auto", None) else settings.kv_cache_dtype
    if kv not in DTYPE_BYTES:
        raise PlanError(f"kv-cache-dtype {kv!r}: the planner sizes {', '.join(DTYPE_BYTES)} KV caches")
    chunked, graph_bs = _gpu_size_defaults(gpu_mem_mib, settings.tp_size)
    if settings.chunked_prefill_size is not None:
        chunked = settings.chunked_prefill_size
    if settings.cuda_graph_max_bs is not None:
        graph_bs = settings.cuda_graph_max_bs
    elif graph_bs > running:
        graph_bs = running
    resolved = Resolved(
        tp=settings.tp_size,
        context_length=context,
        requested_running=running,
        decoder=decoder,
        overlap=overlap,
        radix_strategy=radix,
        mamba_ratio=ratio,
        ssm_dtype=ssm,
        kv_dtype=kv,
        page_size=settings.page_size or 1,
        cuda_graphs=not settings.disable_cuda_graph,
        cuda_graph_max_bs=graph_bs,
        chunked_prefill_size=chunked,
        mem_fraction_static=settings.mem_fraction_static or 0.0,
        mem_fraction_auto=settings.mem_fraction_static is None,
        gpu_mem_mib=gpu_mem_mib,
    )
    if settings.mem_fraction_static is None:
        resolved = replace(resolved, mem_fraction_static=auto_mem_fraction(resolved, pair, settings))
    return resolved


def _gpu_size_defaults(gpu_mem_mib: int, tp: int) -> tuple[int, int]:
    """``handle_gpu_memory_settings``: chunked prefill size and decode CUDA-graph max batch by GPU size."""
    gib = 1024
    if gpu_mem_mib < 20 * gib:
        return 2048, 8
    if gpu_mem_mib < 35 * gib:
        return 4096, 48 if tp < 4 else 160
    if gpu_mem_mib < 60 * gib:
        return 4096, 32 if tp < 4 else 160
    if gpu_mem_mib < 160 * gib:
        return 8192, 256 if tp < 4 else 512
    return 16384, 512


def graph_reserve_mib(r: Resolved) -> float:
    """``memory_hook.reserve_for_graph_mb``: 2 MiB per decode batch size captured (prefill graphs are off
    by default in 0.5.23)."""
    return r.cuda_graph_max_bs * 2 if r.cuda_graphs else 0.0


def activation_reserve_mib(r: Resolved, settings: ServeSettings) -> float:
    """SGLang's own estimate of CUDA-graph and activation memory (``handle_gpu_memory_settings``):
    512 MiB + 1.5 MiB per prefill token + TP slack + ``reserve_for_graph_mb``, at least 10 GiB on
    GPUs above 60 GiB. SGLang measures the real figure only at run time."""
    if r.chunked_prefill_size > 0:
        tokens = max(r.chunked_prefill_size, 2048)
    else:
        tokens = max(settings.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS, 2048)
    reserve = 512 + tokens * 1.5 + r.tp / 8 * 1024 + graph_reserve_mib(r)
    if r.gpu_mem_mib > 60 * 1024:
        reserve = max(reserve, 10 * 1024)
    return reserve


def auto_mem_fraction(r: Resolved, pair: ModelPair, settings: ServeSettings) -> float:
    """``handle_gpu_memory_settings`` when --mem-fraction-static is unset, with its VLM adjustment."""
    gpu = r.gpu_mem_mib
    fraction = round((gpu - activation_reserve_mib(r, settings)) / gpu, 3)
    target = pair.target
    if target.multimodal:  # adjust_mem_fraction_for_vlm (post-capture sizing off)
        complexity = target.vision_layers * (target.vision_hidden or 1024) ** 2 / (24 * 1024**2)
        factor = max(0.8, min(1.05, 1.0 - 0.1 * (complexity - 1.0)))
        fraction = fraction * 0.95 * factor
    return fraction
