"""DDTREE for SGLang through its plugin entry point (``sglang.srt.plugins``).

``pip install ddtree-runtime`` next to the pinned SGLang is all it takes: SGLang calls
:func:`register` in every process (launcher, schedulers, detokenizer) before it parses or uses
arguments. Nothing here is imported unless SGLang loads the plugin, so ``ddtree_runtime`` stays
importable without SGLang.

Site-by-site map of what the plugin covers in SGLang 0.5.23: ``docs/sglang-plugin-sites.md``.

The modules, as a reader of SGLang's ``srt/speculative/`` looks for them (``dflash_info``,
``dflash_worker_v2``, ...):

* start-up, every process: ``registration`` (what :func:`register` does), ``names`` (the fixed
  names), ``cli_args`` (DDTREE's flags), ``algorithm`` (the ``CustomSpecAlgo`` and the resolution of
  the flags into SGLang's fields);
* start-up refusals, the subpackage ``refusals`` (each with the reason and what starts instead):
  ``resolution`` (at argument resolution: refused flags, the attention backend, the hybrid gate),
  ``worker_start`` (at the worker's construction: the width contract, what the tree round cannot serve,
  the graphs' mode);
* hooks on SGLang's own code: ``sites`` (sites that test the name ``"DFLASH"``), ``graph_sites``
  (what the target's CUDA graphs capture for trees), ``server_info`` and ``handshake`` (the
  handshake in ``/server_info`` and ``sglang:ddtree_*`` metrics), ``warmup`` (tree rounds at every
  captured batch size before the server says ready, SGLang's ``--warmups``), ``gdn_verify_kernel``
  (the GDN layers' tree verify on the plugin's recurrence, behind a switch);
* the algorithm's info and worker: ``ddtree_info`` (the verify input SGLang's backends read, the
  round's input from a ``ScheduleBatch``), ``ddtree_worker`` (``DDTreeWorker`` on
  ``DFlashWorkerV2``), ``hidden_guard`` (the hidden-state check after every target forward);
* counterfactual acceptance on live traffic: ``counterfactual_hook`` (the worker scores a sampled
  fraction of greedy decode rounds for every candidate budget, reading nothing back inside a round),
  ``counterfactual_metrics`` (its ``sglang:ddtree_counterfactual_*`` counters on SGLang's ``/metrics``);
* the round's own prices, measured at start-up behind ``--speculative-ddtree-price-table``:
  ``price_table`` (medians of synchronised runs per batch size, only at start-up), ``price_stages``
  (what is timed: the server's captured graphs replayed, else its eager passes, on dummy requests),
  ``price_metrics`` (the table as ``sglang:ddtree_price_*`` gauges on ``/metrics``);
* adaptive widths (``--speculative-ddtree-budget auto`` or a list, docs/adaptive-width.md):
  ``width_metrics`` (``sglang:ddtree_width_*``: rounds per width, each width's own tokens per round, the
  width chosen per batch size);
* one tree round, the subpackage ``round``: ``tree_round`` (the round with its two model passes
  injected), ``sglang_models`` (those passes on SGLang's runners), ``tree_step`` (tree, verify arrays,
  walk in SGLang's layout), ``tree_commit`` (the accepted KV into SGLang's pools), ``hybrid_state``
  (Gated DeltaNet targets' state scratch and commit), ``bounds`` (host sizes from the scheduler's
  bounds, never the device), ``draft_head`` (the drafter's per-depth distribution,
  vocabulary-parallel too), ``round_graphs`` (the round's stages between the drafter and the verify
  and after it, as CUDA graphs per batch size), ``width_choice`` (an adaptive server's width per round
  from its prices and each width's own tokens, counted on the device, read back asynchronously),
  ``width_runners`` (a narrower width's own attention backend and verify graphs, behind a switch),
  ``readback`` (a device tensor to the host by an asynchronous copy and its event: no sync in a round);
* ``check``: ``python -m ddtree_runtime.sglang_plugin.check``, is DDTREE registered here?
"""

from __future__ import annotations

from ddtree_runtime.sglang_plugin.names import ALGORITHM, PINNED_SGLANG_VERSION

__all__ = ["ALGORITHM", "PINNED_SGLANG_VERSION", "register"]


def register() -> None:
    """Entry point: register DDTREE, its flags and its hooks with the running SGLang."""
    from ddtree_runtime.sglang_plugin.registration import register_all

    register_all()
