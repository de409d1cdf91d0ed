"""Shared fixtures for the unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit._tiny_engine import lab_models, one_thread


@pytest.fixture
def torch_one_thread() -> Iterator[None]:
    """Run torch on one thread: the tree tests issue many tiny ops, and on a shared 2-core box
    intra-op threads spin against each other (measured: 33 ms vs 3 ms per small build_tree)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- the tiny engine's tests (issue 42: this set-up was written out in six modules) -------------------
@pytest.fixture(scope="module")
def tiny_one_thread() -> Iterator[None]:
    """Torch on one thread for the rest of the module (``pytestmark = pytest.mark.usefixtures(...)``
    for all of it): the tiny models' ops are small, and on a shared CPU threads spin against each other."""
    with one_thread():
        yield


@pytest.fixture(scope="module")
def models(tiny_one_thread: None) -> Path:
    """The dense lab pair (target/, draft/, draft-mismatched/), made once per source hash; a module of the
    hybrid pair overrides this fixture."""
    return lab_models()


@pytest.fixture(scope="module")
def engines(models: Path) -> dict:
    """One tiny engine per decoding setting on ``models``: AR, DFLASH, DDTREE budgets 16 and 64."""
    from ddtree_runtime.tiny_engine.engine import TinyEngine

    t, d = models / "target", models / "draft"
    return {
        "AR": TinyEngine(t),
        "DFLASH": TinyEngine(t, d, algorithm="DFLASH"),
        "DDTREE16": TinyEngine(t, d, algorithm="DDTREE", budget=16),
        "DDTREE64": TinyEngine(t, d, algorithm="DDTREE", budget=64),
    }


@pytest.fixture(scope="module")
def greedy(engines: dict, request: pytest.FixtureRequest) -> dict[str, tuple[list[list[int]], float]]:
    """Each engine's greedy outputs on all lab prompts as one batch (different prompt lengths), the module's
    ``NEW`` tokens each, and its acceptance length over that batch."""
    from ddtree_runtime.tiny_engine.engine import SamplingParams
    from ddtree_runtime.tiny_engine.language import LAB_PROMPTS

    new = request.module.NEW
    out = {}
    for name, engine in engines.items():
        prompts = [engine.tokenizer.encode(p) for p in LAB_PROMPTS]
        assert len({len(p) for p in prompts}) > 1
        v0, a0 = engine.stats.verify_ct, engine.stats.accepted_sum
        res = engine.generate(prompts, [SamplingParams(max_new_tokens=new)] * len(prompts))
        v, a = engine.stats.verify_ct - v0, engine.stats.accepted_sum - a0
        out[name] = ([r.output_ids for r in res], a / v if v else 1.0)
    return out


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
