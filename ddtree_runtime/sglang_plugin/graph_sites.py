"""What the target's CUDA graphs capture when DDTREE verifies trees.

SGLang 0.5.23 captures the target-verify graph once, at start-up, from a capture input the graph
runner builds for the algorithm, and replays it for every verify whose width matches (budget + 1)
up to the largest captured batch. Two decisions of that capture are DFLASH's and wrong for a tree
(facts: docs/sglang-plugin-sites.md, "CUDA graphs"):

1. the attention mask: ``DecodeCudaGraphRunner.get_spec_info`` captures DFLASH's verify with
   ``custom_mask=None`` when ``resolve_dflash_verify_mask_policy`` says the backend needs none, and
   it says so for Triton, the one backend DDTREE allows for trees. Triton compiles ``USE_CUSTOM_MASK``
   into the kernel, so the tree mask copied into the mask buffer at replay is never read and the
   verify is causal over the tree's rows: siblings see each other;
2. the GDN layers' tree branch: ``MambaAttnBackendBase`` decides "tree" from ``self.topk``, read once
   from ``speculative_eagle_topk`` (1 under DDTREE), and captures the tree kernels and link buffers
   only when it is above 1.

``verify_mask_policy_hook`` makes the target's capture carry the mask buffer in tree configurations;
``linear_backend_tree_hook`` puts the target's GDN backend in tree mode from its construction, so
captures and eager verifies both take the tree branch. The chain case (top-k cap 1) is DFLASH's
decode and keeps DFLASH's graphs. ``capture_trees`` is the one decision both read.
"""

from __future__ import annotations

import logging
from typing import Any

from ddtree_runtime.sglang_plugin.sites import TREE_TOPK

logger = logging.getLogger(__name__)

VERIFY_MASK_POLICY = "sglang.srt.speculative.dflash_utils.resolve_dflash_verify_mask_policy"
LINEAR_BACKEND_INIT = "sglang.srt.layers.attention.hybrid_linear_attn_backend.MambaAttnBackendBase.__init__"


def capture_trees() -> bool:
    """True when this process serves DDTREE tree configurations (published settings, not a chain)."""
    from ddtree_runtime.sglang_plugin.algorithm import is_chain, published_settings

    settings = published_settings()
    return settings is not None and not is_chain(settings)


def verify_mask_policy_hook(original: Any, attn_backend: Any, *args: Any, **kwargs: Any) -> tuple[str, bool]:
    """AROUND ``resolve_dflash_verify_mask_policy`` (``dflash_utils.py`` ~178; its one caller is the
    graph runner's capture input, ``decode_cuda_graph_runner.py`` ~2114): for trees, "build the
    mask", so the target's verify graphs are captured reading ``verify_mask.buffer``. The drafter's
    runner passes no mask whatever this says."""
    name, build_mask = original(attn_backend, *args, **kwargs)
    if capture_trees():
        return name, True
    return name, build_mask


def linear_backend_tree_hook(result: Any, backend: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``MambaAttnBackendBase.__init__`` (``hybrid_linear_attn_backend.py`` ~85): the target's
    linear-attention backend answers "tree" (``topk`` >= 2) from construction in tree
    configurations, so its CUDA-graph capture records the tree kernels and link buffers. The
    drafter's backend (if any) is left alone."""
    if capture_trees() and not getattr(backend, "is_draft_worker", False):
        backend.topk = max(int(backend.topk or 0), TREE_TOPK)
    return None


def register_graph_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(VERIFY_MASK_POLICY, verify_mask_policy_hook, HookType.AROUND)
    HookRegistry.register(LINEAR_BACKEND_INIT, linear_backend_tree_hook, HookType.AFTER)


def linear_backend_in_tree_mode(attn_backend: Any) -> bool | None:
    """None for a dense target; else whether its linear-attention backend takes the tree branch."""
    linear = getattr(attn_backend, "linear_attn_backend", None)
    if linear is None:
        return None
    return int(linear.topk or 0) >= TREE_TOPK
