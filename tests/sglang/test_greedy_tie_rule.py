"""SGLang 0.5.23's own greedy sampler and DDTREE's walk resolve an exact tie of the same logits the same
way: the smallest id (``torch.argmax``). The sampler is SGLang's ``Sampler.forward`` on its all-greedy
path, built without a process group (its constructor only reads the parallel groups and exec config)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ddtree_runtime.core.tree import build_tree
from ddtree_runtime.sglang_plugin.round.tree_round import walk_round
from tests._ties import tied_round

pytestmark = pytest.mark.sglang


def _sglang_sampler():
    from sglang.srt.layers.sampler import Sampler
    from torch import nn

    sampler = Sampler.__new__(Sampler)
    nn.Module.__init__(sampler)
    sampler.tp_sync_group = sampler.cp_sync_group = sampler.rl_on_policy_target = None
    sampler.enable_deterministic = sampler.use_log_softmax_logprob = sampler.use_ascend_backend = False
    sampler.sampling_mask_max_tokens = 0
    return sampler


def _sglang_greedy(logits: torch.Tensor) -> list[int]:
    info = SimpleNamespace(is_all_greedy=True, sampling_mask_batch_indices=None,
                           sampling_support_logprobs_capture_indices=None, has_custom_logit_processor=False,
                           grammars=None)
    out = SimpleNamespace(next_token_logits=logits.clone())
    n = logits.shape[0]
    return _sglang_sampler().forward(out, info, False, [0] * n, [None] * n, torch.zeros(n)).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("budget", [1, 2])
def test_the_walk_emits_what_sglangs_greedy_sampler_picks_at_an_exact_tie(dtype, budget):
    case = tied_round(320, 7, 301, dtype=dtype)
    picked = _sglang_greedy(case.target_logits[0])
    assert picked == [case.lo] * 3  # SGLang: the smallest tied id
    tree = build_tree(case.draft_logits, budget)
    logits = case.target_logits[:, : budget + 1]
    plan = SimpleNamespace(tree=tree, candidates=torch.zeros(1, budget + 1, dtype=torch.long))
    walk = walk_round(plan, logits, None)
    emitted = walk.emitted[0, : int(walk.num_emitted[0])].tolist()
    assert emitted == picked[: len(emitted)] and len(emitted) == budget  # hi rejected, lo accepted
