"""The plugin's fixed names, in a module of their own so that every part can import them without
importing the package's entry point (which imports the parts)."""

from __future__ import annotations

ALGORITHM = "DDTREE"
# The release every site in docs/sglang-plugin-sites.md was read from (and the tests run against).
PINNED_SGLANG_VERSION = "0.5.23"
# SGLang 0.5.23's ServerArgs takes no new fields (its namespaces are fixed at import), so the resolved
# settings (algorithm.PluginSettings) ride on the record as a bookkeeping attribute, pickled with it to every
# scheduler process.
RESOLVED_ATTR = "_ddtree_resolved"
