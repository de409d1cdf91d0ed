"""The DDTREE speculative algorithm as SGLang sees it: a ``CustomSpecAlgo`` that is DFlash-family
by capability, plus its server-argument resolution.

DFlash-family by capability means every predicate SGLang 0.5.23 gates hidden-state capture,
KV/pool sizing, CUDA graphs and scheduling on answers as it does for DFLASH
(``is_dflash_family``, ``supports_target_verify_for_draft``, ...). ``is_dflash()`` is True as
well: its remaining call sites are about the DFlash *drafter* (draft TP geometry, sampling-mask
thresholds, fused draft KV), which DDTREE uses unchanged. The verify width differs:
the target verifies budget + 1 tokens per request while the drafter keeps its own block
(``speculative_dflash_block_size``). ``speculative_num_draft_tokens`` (SGLang's per-request KV
reservation, which the draft block and the verify both write) is the larger of the two;
``get_num_tokens_per_req_for_target_verify`` tells the target's and the drafter's widths apart.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from ddtree_runtime.core.counterfactual import CounterfactualSettings
from ddtree_runtime.core.decoder_settings import VALIDATED_MAX_BUDGET, DecoderSettings, SettingsError
from ddtree_runtime.sglang_plugin import warmup
from ddtree_runtime.sglang_plugin.cli_args import ddtree_args_of
from ddtree_runtime.sglang_plugin.names import ALGORITHM, RESOLVED_ATTR
from ddtree_runtime.sglang_plugin.refusals.resolution import DDTreeConfigError, check_hybrid, check_refusals

logger = logging.getLogger(__name__)

RESOLUTION_SOURCE = "ddtree_plugin"


@dataclass(frozen=True)
class PluginSettings:
    """What the plugin resolved at start-up and its worker runs with: the decoder's settings (the one
    home of budget, block and top-K cap, ``core/decoder_settings.py``) and the plugin's own facts."""

    decoder: DecoderSettings
    allow_hybrid: bool = False
    hybrid_kind: str | None = None  # SGLang's recurrent-state kind of the target; None: pure attention
    contract: dict[str, Any] | None = None  # the hidden-state contract from the files, when local
    algorithm: str = ALGORITHM
    # What the worker scores (counterfactual_hook); None only where settings are built by hand (tests).
    counterfactual: CounterfactualSettings | None = None
    # Measure the round's prices at start-up (--speculative-ddtree-price-table; price_table.py).
    price_table: bool = False

    def with_contract(self, contract: dict[str, Any] | None) -> PluginSettings:
        return replace(self, contract=contract)


class DDTreeSpecAlgo(CustomSpecAlgo):
    """DDTREE: DFlash drafter, best-first draft tree, one tree-masked target verify."""

    # --- DFlash family: capture, pools, CUDA graphs, scheduler -----------------------------
    def is_dflash(self) -> bool:
        return True

    def is_dflash_family(self) -> bool:
        return True

    def supports_target_verify_for_draft(self) -> bool:
        return True

    def supports_prefill_shared_read_done(self) -> bool:
        return True

    def has_draft_kv(self) -> bool:
        return True

    # --- where DDTREE deliberately differs from DFLASH -------------------------------------
    def supports_mixed_chunk(self) -> bool:
        # Mixed chunks put prefill rows beside verify rows; the tree verify path is not audited
        # for that layout, so SGLang turns mixed chunk off (as for any algorithm answering False).
        return False

    def supports_ragged_verify(self) -> bool:
        return False  # every request verifies exactly budget + 1 nodes

    def supports_grammar_overlap(self) -> bool:
        return False  # the tree walk does not advance a grammar FSM inside verify

    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def create_future_map(
        self, device: Any, req_to_token_pool: Any, needs_cpu_seq_lens: bool = True,
        needs_confidence_relay: bool = False,
    ) -> Any:
        # The overlap scheduler asks every algorithm for its FutureMap (Scheduler.init_overlap);
        # 0.5.23's CustomSpecAlgo lacks the method, the enum's builds the DFlash family's map.
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        return SpeculativeAlgorithm.create_future_map(
            self, device, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay
        )

    def build_disagg_draft_input(self, batch, last_tokens_tensor, future_map):
        return None  # disaggregated serving is refused at start-up (refusals.resolution.REFUSALS)

    # --- sizes -----------------------------------------------------------------------------
    def handle_server_args(self, server_args: Any) -> None:
        resolve_server_args(server_args)

    def resolve_max_speculative_num_draft_tokens(self, server_args: Any) -> int | None:
        from sglang.srt.arg_groups.overrides import resolving_view

        cfg = resolving_view(server_args)
        widths = [w for w in (cfg.speculative_num_draft_tokens, cfg.speculative_dflash_block_size) if w]
        return max(int(w) for w in widths) if widths else None

    def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens: int, is_draft_worker: bool) -> int:
        # The drafter runs its block (bonus + masks); the target verifies the tree (budget + 1), or, inside
        # ``verify_width``, one narrower width of an adaptive server.
        settings = published_settings()
        if settings is None:
            return num_draft_tokens
        if is_draft_worker:
            return settings.decoder.block_size
        return _verify_rows_override or settings.decoder.verify_rows


# Set only inside ``verify_width``: what SGLang's runners take as the target's verify rows (its dummy forwards
# size their inputs by it), so an adaptive server's start-up prices each width with SGLang's own passes.
_verify_rows_override: int | None = None


@contextmanager
def verify_width(rows: int | None) -> Iterator[None]:
    """SGLang's runners see ``rows`` verify rows a request while inside (None: the server's widest)."""
    global _verify_rows_override
    saved, _verify_rows_override = _verify_rows_override, rows
    try:
        yield
    finally:
        _verify_rows_override = saved


def published_settings() -> PluginSettings | None:
    """DDTREE's resolved sizes from this process's published ServerArgs (None before publish)."""
    from sglang.srt.runtime_context import get_server_args

    try:
        record = get_server_args()
    except (ValueError, AttributeError):  # nothing published in this process yet
        return None
    return resolved_settings(record)


def _record_of(server_args: Any) -> Any:
    """The ServerArgs record behind the stand-in SGLang hands to plugin resolvers."""
    from sglang.srt.arg_groups.model_override_base import record_of
    from sglang.srt.arg_groups.overrides import _ForeignDefaults

    if isinstance(server_args, _ForeignDefaults):
        return record_of(object.__getattribute__(server_args, "_cfg"))
    return server_args


def is_chain(settings: PluginSettings) -> bool:
    """The chain case (``DecoderSettings.is_chain``): exactly DFlash's argmax chain, decoded by DFlash's
    own code."""
    return settings.decoder.is_chain


def _hybrid_kind(record: Any) -> tuple[str | None, str]:
    """SGLang's own answer to "does this target keep recurrent state, and of which kind?"
    (``refusals.resolution.hybrid_kind``; None: pure attention), and the config class it read."""
    from sglang.srt.arg_groups.model_override_base import model_config_of
    from sglang.srt.configs.hybrid_arch import mambaish_config

    from ddtree_runtime.sglang_plugin.refusals.resolution import hybrid_kind

    model_config = model_config_of(record)
    state_config = mambaish_config(model_config)
    return hybrid_kind(model_config), type(state_config).__name__


def _check_contract(target: str, draft: str) -> dict[str, Any] | None:
    """Width handshake from files, when both models are local directories."""
    from ddtree_runtime.core.contract import load_contract

    if not (os.path.isdir(target) and os.path.isdir(draft)):
        return None
    return load_contract(target, draft).to_dict()  # raises ContractError on a width mismatch


def resolve_server_args(server_args: Any) -> None:
    """Apply DFLASH's defaults, then DDTREE's sizes, gates and refusals (start-up)."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
    from sglang.srt.arg_groups.speculative_hook import _handle_dflash

    record = _record_of(server_args)
    cfg = resolving_view(record)
    args = ddtree_args_of(record)
    if cfg.speculative_num_draft_tokens is not None:
        raise DDTreeConfigError(
            "DDTREE sets the verify width from --speculative-ddtree-budget (width = budget + 1) and "
            "the drafter block from the draft config; drop --speculative-num-draft-tokens "
            f"(got {cfg.speculative_num_draft_tokens}). --speculative-dflash-block-size still "
            "overrides the drafter block."
        )
    try:
        _handle_dflash(record)  # device, pp, draft path, steps/topk = 1, block size, mrr 48
    except ValueError as exc:
        raise DDTreeConfigError(f"DDTREE builds on DFLASH, which refused: {exc}") from exc
    check_refusals(cfg)
    block = int(cfg.speculative_num_draft_tokens)
    if block < 2:
        raise DDTreeConfigError(f"DDTREE needs a drafter block of at least 2 (got {block}).")
    try:
        decoder = DecoderSettings.resolve(args.budget, block, args.topk_cap)
    except SettingsError as exc:
        raise DDTreeConfigError(f"DDTREE: {exc}") from None
    try:
        counterfactual = CounterfactualSettings.resolve(
            args.counterfactual_fraction, args.counterfactual_budgets, decoder.horizon
        )
    except ValueError as exc:
        raise DDTreeConfigError(f"DDTREE: {exc}") from None
    kind, config_class = _hybrid_kind(record)
    check_hybrid(
        str(cfg.model_path), kind, config_class, allow_hybrid=args.allow_hybrid, chain=decoder.is_chain,
        block=block,
    )
    contract = _check_contract(str(cfg.model_path), str(cfg.speculative_draft_model_path))
    sizes = {
        "speculative_dflash_block_size": decoder.block_size,
        "speculative_num_draft_tokens": decoder.kv_window,
    }
    # Trees keep SGLang's overlap scheduler, as DFLASH does: the tree round reads nothing back to the
    # host (tree_round; tests/sglang/test_tree_round_sync.py, the GPU suite's sync watch), and the
    # GPU suite is token-identical with it (docs/bench/overlap-tree-round.md). It stays off where
    # SGLang's resolution turns it off (pp > 1, --disable-overlap-schedule); SGLang's CPU turn-off is
    # for its EAGLE and NGRAM families only, so the CPU lab runs trees overlapped, as the chain.
    declared: dict[str, Any] = dict(sizes)
    if not decoder.is_chain and warmup.wanted(cfg.device, cfg.disable_cuda_graph):
        # Tree rounds at every captured batch size before the server says ready (warmup.py).
        declared["warmups"] = warmup.with_warmup(cfg.warmups)
    declare_resolution(record, RESOLUTION_SOURCE, **declared)
    resolved = PluginSettings(
        decoder, allow_hybrid=args.allow_hybrid, hybrid_kind=kind, contract=contract,
        counterfactual=counterfactual, price_table=args.price_table or decoder.adaptive,
    )  # fmt: skip
    setattr(record, RESOLVED_ATTR, resolved)
    if decoder.adaptive:
        logger.info(
            "DDTREE: adaptive budgets %s (verify widths %s, each round the one its batch size pays for; KV "
            "window %d), drafter block %d, top-k cap %s",
            list(decoder.budgets), [b + 1 for b in decoder.budgets], decoder.kv_window, decoder.block_size,
            decoder.topk_cap,
        )  # fmt: skip
    else:
        logger.info(
            "DDTREE: budget %d (verify width %d), drafter block %d, top-k cap %s",
            decoder.budget, decoder.verify_rows, decoder.block_size, decoder.topk_cap,
        )
    if not decoder.validated:
        logger.warning(
            "DDTREE budget %d is above %d, the largest shown lossless on the H200 with CUDA graphs on "
            "(docs/bench/gpu-lab-server.md: budget 64 differed from plain decoding on one lab prompt); "
            "run `ddtree probe live` on this server before it takes traffic.",
            decoder.budget, VALIDATED_MAX_BUDGET,
        )


def resolved_settings(record: Any) -> PluginSettings | None:
    """The settings :func:`resolve_server_args` left on a ServerArgs record (None before resolution)."""
    return getattr(record, RESOLVED_ATTR, None) if record is not None else None
