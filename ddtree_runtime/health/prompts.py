"""The fixed prompts the live probe and the canary send when none are given; the server benchmark and the
GPU lab's cases send some of them too (with the lab language's, tiny_engine.language.LAB_PROMPTS)."""

from __future__ import annotations

# Fixed prompts: short, answerable, stable at T=0. Their answers are recorded so a canary can
# compare live and shadow token for token.
CAPITAL = "The capital of France is"
COUNT = "Count from one to ten: one, two, three,"
CODE = "def fibonacci(n):"
DEFAULT_PROMPTS = (CAPITAL, COUNT, CODE)
