"""The tree step's SGLang-layout arrays on CUDA (``ddtree_runtime.core.kernels`` dispatched by the tree
module) equal the CPU path's. Needs a GPU, not SGLang: SGLang's CUDA wheels are not on our GPU
machine, and this checks our side of the seam only."""

from __future__ import annotations

import pytest
import torch

from ddtree_runtime.sglang_plugin.round.tree_step import (
    accept_from_posterior,
    gather_accepted_hidden,
    plan_tree_verify,
    window_permutation,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CASES = [  # (seed, batch, horizon, vocab, budget, topk_cap)
    (0, 1, 15, 4096, 16, None),
    (1, 4, 15, 32000, 32, None),
    (2, 8, 15, 151936, 64, 8),
    (3, 3, 7, 1000, 24, 2),
    (4, 2, 15, 248320, 128, None),
]


def _path_posterior(plan, gen, vocab):
    b, rows = plan.candidates.shape
    post = torch.randint(0, vocab, (b, rows), generator=gen)
    parents = plan.tree.parents.cpu()
    cand = plan.candidates.cpu()
    for r in range(b):
        node = 0
        for _ in range(int(torch.randint(0, plan.tree.horizon + 1, (1,), generator=gen))):
            kids = [i for i in range(1, rows) if int(parents[r, i]) == node]
            if not kids:
                break
            kid = kids[int(torch.randint(0, len(kids), (1,), generator=gen))]
            post[r, node] = cand[r, kid]
            node = kid
    return post


@pytest.mark.parametrize(("seed", "batch", "horizon", "vocab", "budget", "topk_cap"), CASES)
def test_cuda_round_equals_cpu_round(seed, batch, horizon, vocab, budget, topk_cap):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, horizon, vocab, generator=gen) * 4
    roots = torch.randint(0, vocab, (batch,), generator=gen)
    prefix = torch.randint(1, 300, (batch,), generator=gen)
    cpu = plan_tree_verify(logits, roots, prefix, budget, topk_cap=topk_cap)
    gpu = plan_tree_verify(logits.cuda(), roots.cuda(), prefix.cuda(), budget, topk_cap=topk_cap)
    for name in ("candidates", "positions", "custom_mask", "retrieve_index",
                 "retrieve_next_token", "retrieve_next_sibling"):
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name
    post = _path_posterior(cpu, gen, vocab)
    acc_cpu = accept_from_posterior(cpu, post)
    acc_gpu = accept_from_posterior(gpu, post.cuda())
    assert torch.equal(acc_gpu.accept_index.cpu(), acc_cpu.accept_index)
    assert torch.equal(acc_gpu.bonus.cpu(), acc_cpu.bonus)
    window = max(budget + 1, horizon + 1)
    assert torch.equal(window_permutation(acc_gpu, window).cpu(), window_permutation(acc_cpu, window))
    hidden = torch.randn(batch * (budget + 1), 64, generator=gen)
    on_gpu = gather_accepted_hidden(hidden.cuda(), acc_gpu).cpu()
    assert torch.equal(on_gpu, gather_accepted_hidden(hidden, acc_cpu))
