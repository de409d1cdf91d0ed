"""Statistics the real-server suites share (CPU: tests/sglang, H200: tests/gpu)."""

from __future__ import annotations

import math
from collections import Counter


def homogeneity_p_value(a: list[int], b: list[int]) -> float:
    """Chi-square test that two samples of token ids come from one distribution: tokens seen fewer than
    10 times in both together are pooled; the p-value by the Wilson-Hilferty approximation."""
    counts_a, counts_b = Counter(a), Counter(b)
    kept = [t for t in counts_a | counts_b if counts_a[t] + counts_b[t] >= 10]
    table = [(counts_a[t], counts_b[t]) for t in kept]
    table.append((len(a) - sum(x for x, _ in table), len(b) - sum(y for _, y in table)))
    table = [row for row in table if sum(row) > 0]
    df = len(table) - 1
    if df < 1:
        return 1.0
    n_a, n_b = len(a), len(b)
    stat = 0.0
    for x, y in table:
        total = x + y
        for observed, n in ((x, n_a), (y, n_b)):
            expected = total * n / (n_a + n_b)
            stat += (observed - expected) ** 2 / expected
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))
