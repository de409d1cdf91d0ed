"""Shared fixtures for the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def torch_one_thread() -> Iterator[None]:
    """Run torch on one thread: the tree tests issue many tiny ops, and on a shared 2-core box
    intra-op threads spin against each other (measured: 33 ms vs 3 ms per small build_tree)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
