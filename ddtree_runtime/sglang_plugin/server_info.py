"""Expose the DDTREE settings and handshake in ``/server_info`` (and ``/get_server_info``).

Two processes are involved: the scheduler owns the worker (observed width), the HTTP server
builds the answer. The scheduler adds ``ddtree_handshake`` to its internal state (which
``/server_info`` already lists under ``internal_states``); the tokenizer manager remembers the
latest one while it collects those states; ``build_server_info`` then puts it at the top level,
falling back to the launch-time handshake before the scheduler has reported.
"""

from __future__ import annotations

import uuid
from typing import Any

from ddtree_runtime import __version__
from ddtree_runtime.sglang_plugin.algorithm import resolved_settings
from ddtree_runtime.sglang_plugin.handshake import static_handshake

BUILD_SERVER_INFO = "sglang.srt.utils.common.build_server_info"
ADD_SPECULATIVE = (
    "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController._add_speculative"
)
GET_INTERNAL_STATE = "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.get_internal_state"

_latest_live: dict[str, Any] | None = None
# One per server process that builds /server_info: the canary tells live from shadow by it, not by URL.
INSTANCE_ID = uuid.uuid4().hex


def add_to_server_info(result: dict[str, Any], server_args: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    result["ddtree_instance_id"] = INSTANCE_ID
    settings = resolved_settings(server_args)
    if settings is None:
        return result
    result["ddtree_runtime_version"] = __version__  # which build serves (the canary compares it)
    result["speculative_ddtree_budget"] = settings.decoder.budget
    if settings.decoder.adaptive:  # the budget above is the widest; each round picks one of these
        result["speculative_ddtree_widths"] = list(settings.decoder.budgets)
    result["speculative_ddtree_topk_cap"] = settings.decoder.topk_cap
    result["speculative_ddtree_allow_hybrid"] = settings.allow_hybrid
    # What the scheduler decides its loop by (Scheduler.enable_overlap): on for trees and the chain,
    # off wherever SGLang's own resolution turns it off (pp > 1, --disable-overlap-schedule).
    result["ddtree_overlap_schedule"] = not bool(result.get("disable_overlap_schedule", False))
    result["ddtree_handshake"] = _latest_live or static_handshake(settings)
    return result


def add_to_internal_state(
    result: Any, controller: Any, state: dict[str, Any], *args: Any, **kwargs: Any
) -> None:
    worker = getattr(controller.scheduler, "draft_worker", None)
    handshake = getattr(worker, "ddtree_handshake", None)
    if callable(handshake):
        state["ddtree_handshake"] = handshake()
    prices = getattr(worker, "ddtree_prices", None)
    table = prices() if callable(prices) else None
    if table is not None:  # --speculative-ddtree-price-table (price_table.py)
        state["ddtree_prices"] = table
    widths = getattr(worker, "ddtree_widths", None)
    choice = widths() if callable(widths) else None
    if choice is not None:  # an adaptive server (round/width_choice.py)
        state["ddtree_widths"] = choice


async def remember_live_handshake(original: Any, *args: Any, **kwargs: Any) -> Any:
    global _latest_live
    states = await original(*args, **kwargs)
    for state in states or ():
        if isinstance(state, dict) and isinstance(state.get("ddtree_handshake"), dict):
            _latest_live = state["ddtree_handshake"]
            break
    return states


def register_server_info_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(BUILD_SERVER_INFO, add_to_server_info, HookType.AFTER)
    HookRegistry.register(ADD_SPECULATIVE, add_to_internal_state, HookType.AFTER)
    HookRegistry.register(GET_INTERNAL_STATE, remember_live_handshake, HookType.AROUND)
