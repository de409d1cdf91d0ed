"""Fixtures for tests that run SGLang's real code (the pinned release, installed --no-deps) on CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

SGLANG_MISSING = importlib.util.find_spec("sglang") is None
if not SGLANG_MISSING:
    # Before anything imports sglang (its import chain imports torchvision): see _cpu_env.
    from tests.sglang._cpu_env import define_torchvision_op_schemas

    define_torchvision_op_schemas()
SKIP_REASON = (
    "sglang is not importable in this interpreter; `make venv` installs it "
    "(requirements/sglang-test.txt + `pip install --no-deps sglang==0.5.23`)"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not SGLANG_MISSING:
        return
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents and item.get_closest_marker("sglang") is not None:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session")
def sglang_plugins() -> Any:
    """SGLang with its general plugins loaded through the real entry-point discovery."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return SpeculativeAlgorithm


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    """A pure-attention Qwen3-8B-shaped target and its DFlash drafter (configs + safetensors header)."""
    from tests.fixtures_models import write_pair

    return write_pair(tmp_path, "qwen3-8b")


def ddtree_argv(target: Path, draft: Path, *extra: str) -> list[str]:
    # --device cuda: SGLang >= 0.5.21 refuses DFlash-family algorithms on device cpu at
    # resolution; nothing here touches a GPU (resolution only reads configs).
    return [
        "--model-path", str(target),
        "--speculative-algorithm", "DDTREE",
        "--speculative-draft-model-path", str(draft),
        "--device", "cuda",
        *extra,
    ]


def resolve(argv: list[str]) -> tuple[Any, Any]:
    """Parse with SGLang's own parser and run its resolution pipeline; (record, resolved view)."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args

    record = prepare_server_args(argv)
    record.resolve_once()
    return record, resolving_view(record)
