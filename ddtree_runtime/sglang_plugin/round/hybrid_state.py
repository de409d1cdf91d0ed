"""DDTREE trees on hybrid Gated DeltaNet (GDN) targets, through SGLang 0.5.23's own tree machinery.

SGLang already verifies trees on GDN layers for EAGLE top-k > 1 (docs/hybrid-verify.md): the conv
kernel derives each row's parent from first-child / next-sibling links and convolves every token with
its own ancestors; the recurrent kernel starts row i from parent(i)'s saved state; every row's state
and conv window go to per-row scratch; a tree-aware commit copies the accepted node's state into the
request's slot. DDTREE reaches that code with four seams, no edited SGLang file
(docs/sglang-plugin-sites.md, "Hybrid GDN targets"):

1. ``ddtree_info.DDTreeVerifyInput``: DFlash's verify input plus ``retrieve_next_token`` /
   ``retrieve_next_sibling`` (our tree's links, rows in parent-before-child order), the fields the
   hybrid backend reads in its tree branch;
2. ``graph_sites.linear_backend_tree_hook``: the backend decides "tree" from ``self.topk``, read once
   at start-up from ``speculative_eagle_topk`` (1 under DDTREE); in tree configurations the target's
   backend answers "tree" from its construction, so CUDA-graph captures and eager verifies alike
   take the tree branch (raising it only around a verify left the chain kernels in the graphs);
3. ``sites.conv_window_dedup_hook``: SGLang picks the deduplicated (overlapping) conv scratch for top-k <= 1
   on CUDA, right only for chains; for DDTREE trees the pool gets the dense per-row layout;
4. ``commit_tree_state``: ``spec_utils.commit_mamba_states_after_verify`` with the walk's accepted
   rows (after stop-token truncation), which maps the accepted leaf to its node index (and the mamba
   radix track slots), before any other target forward.

Hybrid kinds whose verify kernels take no parent pointers, or that nobody audited for them, are
refused at start-up (``gates.check_hybrid``, on ``gates.hybrid_kind``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from ddtree_runtime.sglang_plugin.sites import CONV_WINDOW_DEDUP

logger = logging.getLogger(__name__)


# --- seam 3: dense conv scratch (the hook lives in sites.py: registration imports nothing heavy) ----
class HybridScratchError(RuntimeError):
    """The hybrid state pool cannot hold a tree's per-row states (the message says why)."""


def check_tree_scratch(req_to_token_pool: Any, verify_rows: int) -> None:
    """Worker start: the pool's verify scratch exists, is wide enough for ``verify_rows`` rows,
    and uses the dense per-row conv layout (the deduplicated view is an overlapping, hence
    non-contiguous, ``as_strided`` tensor)."""
    cache = getattr(getattr(req_to_token_pool, "mamba_pool", None), "mamba_cache", None)
    windows = getattr(cache, "intermediate_conv_window", None)
    if cache is None or windows is None or getattr(cache, "intermediate_ssm", None) is None:
        raise HybridScratchError(
            "the hybrid state pool has no per-row verify scratch (intermediate_ssm / "
            "intermediate_conv_window): was it built without speculative draft tokens, or with "
            "--enable-linear-replayssm-spec?"
        )
    steps = int(cache.intermediate_ssm.shape[2])
    if steps < verify_rows:
        raise HybridScratchError(
            f"the hybrid verify scratch holds {steps} rows per request; a DDTREE verify writes "
            f"{verify_rows} (budget + 1)"
        )
    for window in windows:
        if not window.is_contiguous():
            raise HybridScratchError(
                "the hybrid pool's conv scratch uses the deduplicated chain layout, which commits "
                "wrong conv windows for tree nodes; the ddtree plugin's hook on "
                f"{CONV_WINDOW_DEDUP} did not run before the pool was built (is SGLANG_PLUGINS "
                "set for the scheduler processes?)"
            )


# --- seam 4: the commit --------------------------------------------------------------------------
def commit_tree_state(
    target_worker: Any, batch: Any, accept_index: Tensor, commit_lens: Tensor, verify_rows: int
) -> None:
    """Commit each request's accepted node's SSM state and conv window (and the mamba radix track
    slots) with SGLang's tree-aware commit. ``accept_index [b, L+1]``: flat verify rows of the
    accepted path (root first, -1 padded), after stop-token truncation; ``commit_lens [b]``: the
    rows kept (accepted drafts + bonus). Must run after the verify and before any other target
    forward: the request's slot comes from the backend's current forward metadata."""
    from sglang.srt.speculative.spec_utils import commit_mamba_states_after_verify

    commit_mamba_states_after_verify(
        target_worker,
        batch,
        accept_lens=commit_lens.to(torch.int64),
        accept_index=accept_index.to(torch.int64),
        draft_token_num=int(verify_rows),
    )
