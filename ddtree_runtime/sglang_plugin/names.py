"""The plugin's fixed names, in a module of their own so that every part can import them without
importing the package's entry point (which imports the parts)."""

from __future__ import annotations

ALGORITHM = "DDTREE"
# The release every site in docs/sglang-plugin-sites.md was read from (and the tests run against).
PINNED_SGLANG_VERSION = "0.5.23"
