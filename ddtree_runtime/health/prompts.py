"""The fixed prompts the live probe and the canary send when none are given."""

from __future__ import annotations

# Fixed prompts: short, answerable, stable at T=0. Their answers are recorded so a canary can
# compare live and shadow token for token.
DEFAULT_PROMPTS = (
    "The capital of France is",
    "Count from one to ten: one, two, three,",
    "def fibonacci(n):",
)
