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


@pytest.fixture(scope="session")
def qwen36_models_json(tmp_path_factory: pytest.TempPathFactory):
    """Qwen3.6-27B-shaped model files (headers only), described as the deploy describes them on a host
    (`model_files.py describe`): what `ddtree plan --models-json` and `ddtree tune --models-json` read."""
    import json

    from ddtree_runtime.core.model_files import describe_model_files
    from tests.fixtures_models import write_full_checkpoint_pair

    target, draft = write_full_checkpoint_pair(tmp_path_factory.mktemp("qwen36"), "qwen3.6-27b")
    path = tmp_path_factory.mktemp("describe") / "models.json"
    path.write_text(json.dumps({"target": describe_model_files(target, "target"),
                                "draft": describe_model_files(draft, "draft")}))  # fmt: skip
    return path
