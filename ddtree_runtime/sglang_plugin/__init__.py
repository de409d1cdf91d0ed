"""DDTREE for SGLang through its plugin entry point (``sglang.srt.plugins``).

``pip install ddtree-runtime`` next to the pinned SGLang is all it takes: SGLang calls
:func:`register` in every process (launcher, schedulers, detokenizer) before it parses or uses
arguments. Nothing here is imported unless SGLang loads the plugin, so ``ddtree_runtime`` stays
importable without SGLang.

Site-by-site map of what the plugin covers in SGLang 0.5.23: ``docs/sglang-plugin-sites.md``.
"""

from __future__ import annotations

from ddtree_runtime.sglang_plugin.names import ALGORITHM, PINNED_SGLANG_VERSION

__all__ = ["ALGORITHM", "PINNED_SGLANG_VERSION", "register"]


def register() -> None:
    """Entry point: register DDTREE, its flags and its hooks with the running SGLang."""
    from ddtree_runtime.sglang_plugin.registration import register_all

    register_all()
