"""Run by test_tree_verify_kernel.py in a child process with TRITON_INTERPRET=1 (the variable must
be set before Triton decorates SGLang's kernels). Prints one JSON line per case."""

from __future__ import annotations

import json
import sys

import torch

from tests.sglang._cpu_env import define_torchvision_op_schemas

define_torchvision_op_schemas()

from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_triton  # noqa: E402

from ddtree_runtime.sglang_plugin.round.tree_step import accept_from_posterior, plan_tree_verify  # noqa: E402


def posterior_along_a_path(plan, generator: torch.Generator, vocab: int) -> torch.Tensor:
    """Target tokens per node that follow a random root path of the tree for a random number of
    steps, then disagree: acceptance lengths vary from 1 to the path's end."""
    b, rows = plan.candidates.shape
    post = torch.randint(0, vocab, (b, rows), generator=generator)
    for r in range(b):
        node = 0
        want = int(torch.randint(0, plan.tree.horizon + 1, (1,), generator=generator))
        for _ in range(want):
            children = [i for i in range(1, rows) if int(plan.tree.parents[r, i]) == node]
            if not children:
                break
            child = children[int(torch.randint(0, len(children), (1,), generator=generator))]
            post[r, node] = plan.candidates[r, child]
            node = child
    return post


def run_case(seed: int, batch: int, horizon: int, vocab: int, budget: int, topk_cap: int | None) -> dict:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, horizon, vocab, generator=gen) * 3
    roots = torch.randint(0, vocab, (batch,), generator=gen)
    prefix = torch.randint(1, 40, (batch,), generator=gen)
    plan = plan_tree_verify(logits, roots, prefix, budget, topk_cap=topk_cap)
    post = posterior_along_a_path(plan, gen, vocab)
    ours = accept_from_posterior(plan, post)

    rows = plan.draft_token_num
    predicts = torch.zeros(batch * rows, dtype=torch.int32)
    accept_index = torch.full((batch, horizon + 1), -1, dtype=torch.int32)
    accept_num = torch.empty((batch,), dtype=torch.int32)
    verify_tree_greedy_triton(
        predicts, accept_index, accept_num,
        plan.candidates, plan.retrieve_index, plan.retrieve_next_token, plan.retrieve_next_sibling,
        post,
    )
    last = ours.accept_index.gather(1, (ours.walk.num_accepted - 1).unsqueeze(1)).squeeze(1)
    return {
        "seed": seed, "batch": batch, "budget": budget, "topk_cap": topk_cap,
        "ours_accept_index": ours.accept_index.tolist(),
        "sglang_accept_index": accept_index.long().tolist(),
        "ours_accept_length": ours.accept_length.tolist(),
        "sglang_accept_length": accept_num.long().tolist(),
        "ours_bonus": ours.bonus.tolist(),
        "sglang_bonus": predicts.long()[last].tolist(),
    }


if __name__ == "__main__":
    cases = [
        (0, 1, 4, 7, 6, None),
        (1, 3, 5, 11, 9, None),
        (2, 2, 7, 13, 24, 3),
        (3, 4, 15, 32, 15, None),
        (4, 2, 3, 5, 10, 2),
        (5, 1, 6, 9, 1, None),
    ]
    for case in cases:
        print(json.dumps(run_case(*case)))
    sys.stdout.flush()
