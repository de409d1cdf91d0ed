"""The CUDA twin of tests/unit/test_greedy_tie_rule.py: on the GPU, the compiled walk kernels (the path
``tree.walk_greedy`` dispatches to on CUDA, full and per-depth) resolve an exact tie of the target's
logits to the smallest id, as SGLang's greedy sampler (``torch.argmax`` on the same device) does."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from ddtree_runtime.core.tree import build_tree, walk_greedy  # noqa: E402
from tests._ties import sglang_greedy, tied_round  # noqa: E402

# Inside one tile, across tiles, and Qwen's vocabulary (split-V chunks).
CASES = [(320, 7, 301), (5000, 7, 4500), (151936, 7, 151000)]


def _check(num, emitted, case, budget: int) -> None:
    assert int(sglang_greedy(case.target_logits[0, 0])) == case.lo
    if budget == 1:
        assert num.tolist() == [1] and emitted[0, 0].item() == case.lo
    else:
        assert num.tolist() == [2] and emitted[0, :2].tolist() == [case.lo, case.lo]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("vocab", "lo", "hi"), CASES)
def test_an_exact_tie_goes_to_the_smallest_id_on_the_gpu(vocab, lo, hi, dtype):
    from ddtree_runtime.core.kernels.walk import walk_arrays

    for budget in (1, 2):
        case = tied_round(vocab, lo, hi, dtype=dtype, device="cuda")
        tree = build_tree(case.draft_logits, budget)
        logits = case.target_logits[:, : budget + 1].contiguous()
        walk = walk_greedy(tree, logits)
        _check(walk.num_accepted, walk.emitted, case, budget)
        for lazy in (False, True):
            _, num, _, emit, _ = walk_arrays(tree.tokens, tree.parents, tree.horizon, logits, lazy=lazy)
            _check(num, emit, case, budget)
