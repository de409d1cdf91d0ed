"""Hooks and overrides for the SGLang 0.5.23 sites that test the literal name ``"DFLASH"`` or
the enum member instead of a predicate (docs/sglang-plugin-sites.md has the full table; the
sites handled by a start-up refusal live in ``refusals/resolution.py``).

Every hook is registered through SGLang's ``HookRegistry`` and applied by ``load_plugins()``.
Each one changes behaviour only when the running algorithm is DDTREE.
"""

from __future__ import annotations

import logging
from typing import Any

from ddtree_runtime.sglang_plugin.names import ALGORITHM

logger = logging.getLogger(__name__)

SPEC_NEED_HIDDEN_STATES = "sglang.srt.speculative.spec_utils.spec_need_hidden_states"
HANDLE_SPECULATIVE_DECODING = "sglang.srt.arg_groups.speculative_hook.handle_speculative_decoding"
METRICS_REPORTER = "sglang.srt.managers.scheduler_components.metrics_reporter"
CONV_WINDOW_DEDUP = "sglang.srt.mem_cache.memory_pool.conv_window_dedup_enabled"
GRAMMAR_REQUEST = "sglang.srt.constrained.grammar_manager.GrammarManager.process_req_with_grammar"
GRAMMAR_REFUSAL = (
    "DDTREE tree decode does not serve grammar-constrained requests (json_schema, regex, ebnf, "
    "structural_tag): the tree walk does not advance a grammar. Serve them from a DFLASH server or "
    "DDTREE's chain case (--speculative-ddtree-topk-cap 1)."
)
# Any top-k above 1 selects SGLang's tree branch and dense conv scratch; DDTREE has no top-k of its
# own (the tree's branching varies per node), so it states "a tree" with the smallest such value.
TREE_TOPK = 2


def _running_ddtree() -> bool:
    from sglang.srt.runtime_context import get_spec

    try:
        name = get_spec().speculative_algorithm
    except ValueError:  # nothing published in this process
        return False
    return isinstance(name, str) and name.upper() == ALGORITHM


def spec_need_hidden_states_hook(original: Any, *args: Any, **kwargs: Any) -> bool:
    """spec_utils.py:412 lists STANDALONE/DFLASH/DSPARK by name as "no hidden-state relay through
    the FutureMap". DDTREE's drafter takes its context from the draft KV, like DFLASH."""
    if _running_ddtree():
        return False
    return original(*args, **kwargs)


def handle_speculative_decoding_hook(original: Any, server_args: Any, *args: Any, **kwargs: Any) -> Any:
    """speculative_hook.py:213 warns that --speculative-draft-window-size has no effect for any
    algorithm but EAGLE/EAGLE3/DFLASH. DDTREE's drafter is DFlash's and does honour it."""
    result = original(server_args, *args, **kwargs)
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    name = cfg.speculative_algorithm
    if isinstance(name, str) and name.upper() == ALGORITHM and cfg.speculative_draft_window_size:
        logger.warning(
            "DDTREE honours --speculative-draft-window-size=%s (its drafter is DFlash's): "
            "the 'has no effect' warning above does not apply.",
            cfg.speculative_draft_window_size,
        )
    return result


def include_in_spec_decode_snapshot(algo: Any) -> None:
    """metrics_reporter.py:65 keys per-step decode KV snapshots on a tuple of enum members
    (EAGLE, EAGLE3, DFLASH, DSPARK); add the registered DDTREE instance to it."""
    import importlib

    module = importlib.import_module(METRICS_REPORTER)
    current = module._SPEC_DECODE_SNAPSHOT_ALGORITHMS
    if algo not in current:
        module._SPEC_DECODE_SNAPSHOT_ALGORITHMS = (*current, algo)


def _ddtree_verifies_trees() -> bool:
    from ddtree_runtime.sglang_plugin.algorithm import is_chain, published_settings

    settings = published_settings()
    return settings is not None and not is_chain(settings)


def conv_window_dedup_hook(
    original: Any, is_npu: bool, is_cpu: bool, speculative_eagle_topk: int | None, is_kda: bool
) -> bool:
    """memory_pool.py ~135 ``conv_window_dedup_enabled`` (AROUND): the overlapping conv scratch stores
    one shared sliding window per request, which only a chain fills correctly (hybrid.py, seam 3).
    When DDTREE verifies trees, SGLang's own rule is asked as for a tree (top-k > 1): "dense"."""
    if _ddtree_verifies_trees():
        speculative_eagle_topk = max(int(speculative_eagle_topk or 0), TREE_TOPK)
    return original(is_npu, is_cpu, speculative_eagle_topk, is_kda)


def _constrained(req: Any) -> bool:
    params = req.sampling_params
    return any(
        getattr(params, name, None) is not None for name in ("json_schema", "regex", "ebnf", "structural_tag")
    )


def grammar_request_hook(original: Any, manager: Any, req: Any, *args: Any, **kwargs: Any) -> bool:
    """grammar_manager.py ~148 ``process_req_with_grammar`` (AROUND): under DDTREE trees a constrained
    request is finished with an error, as SGLang finishes one when no grammar backend runs; in the
    batch it would raise in tree decode, and that ends the scheduler for every client."""
    if _ddtree_verifies_trees() and _constrained(req):
        req.set_finish_with_abort(GRAMMAR_REFUSAL)
        return False
    return original(manager, req, *args, **kwargs)


def register_site_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(SPEC_NEED_HIDDEN_STATES, spec_need_hidden_states_hook, HookType.AROUND)
    HookRegistry.register(HANDLE_SPECULATIVE_DECODING, handle_speculative_decoding_hook, HookType.AROUND)
    HookRegistry.register(CONV_WINDOW_DEDUP, conv_window_dedup_hook, HookType.AROUND)
    HookRegistry.register(GRAMMAR_REQUEST, grammar_request_hook, HookType.AROUND)
