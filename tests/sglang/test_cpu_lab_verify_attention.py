"""The lab CPU layer's target-verify attention (``ddtree_sglang_cpu_lab.verify_attention``) against plain
references: it decides what attention computes on the real-SGLang lab host, so every case is checked
against attention computed the obvious way.

* tree (DDTREE's custom mask): each node's row equals plain attention of the node over the committed
  prefix and its own root-to-node path, as if that path were an ordinary sequence;
* chain (no mask, causal target layers): plain causal attention over prefix + block;
* drafter block (no mask, non-causal layers): plain attention over prefix + the whole block.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from ddtree_runtime.sglang_plugin.round.tree_step import plan_tree_verify

verify = pytest.importorskip("ddtree_sglang_cpu_lab.verify_attention")

HQ, HKV, D = 4, 2, 8
POOL = 256


def _pool(prefix_lens: list[int], seed: int):
    """K/V pool and a req_to_token whose rows point at scattered slots (as a real pool's do)."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(POOL, HKV, D, generator=g)
    v_cache = torch.randn(POOL, HKV, D, generator=g)
    req_to_token = torch.randperm(POOL, generator=g)[: 4 * 60].view(4, 60).to(torch.int32)
    idx = torch.tensor([2, 0, 3][: len(prefix_lens)])
    return k_cache, v_cache, req_to_token, idx


def _plain(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """q [n, Hq, D], keys/values [m, Hkv, D] -> [n, Hq, D]; GQA by repeating the KV heads."""
    rep = HQ // HKV
    k = keys.repeat_interleave(rep, dim=1).movedim(0, 1)
    v = values.repeat_interleave(rep, dim=1).movedim(0, 1)
    mask = None
    if causal:  # the n queries are the last n of the m positions
        n, m = q.shape[0], keys.shape[0]
        mask = torch.ones(n, m, dtype=torch.bool).tril(diagonal=m - n)
    return scaled_dot_product_attention(q.movedim(0, 1), k, v, attn_mask=mask).movedim(0, 1)


def _random_rows(b: int, rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b * rows, HQ, D, generator=g), torch.randn(b * rows, HKV, D, generator=g),
            torch.randn(b * rows, HKV, D, generator=g))  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_rows_attend_exactly_to_the_prefix_and_their_root_to_node_path(seed):
    prefix_lens = [7, 3, 11]
    b, budget, depth, vocab = len(prefix_lens), 12, 5, 9
    g = torch.Generator().manual_seed(100 + seed)
    logits = torch.randn(b, depth, vocab, generator=g) * 2
    plan = plan_tree_verify(logits, torch.tensor([1, 2, 3]), torch.tensor(prefix_lens), budget)
    rows = budget + 1
    k_cache, v_cache, req_to_token, idx = _pool(prefix_lens, seed)
    q, k_new, v_new = _random_rows(b, rows, seed)
    out = verify.verify_attention(
        q, k_new, v_new, k_cache, v_cache, req_to_token, idx, torch.tensor(prefix_lens),
        custom_mask=plan.custom_mask, causal=True, scaling=None,
    )  # fmt: skip
    parents = plan.tree.parents
    branching = 0
    for r, prefix in enumerate(prefix_lens):
        slots = req_to_token[idx[r], :prefix].long()
        for node in range(rows):
            path, cur = [], node
            while cur >= 0:
                path.append(cur)
                cur = int(parents[r, cur])
            path.reverse()  # root .. node
            branching += len(path) < node + 1  # a node whose path skips rows: a real tree
            flat = [r * rows + i for i in path]
            keys = torch.cat([k_cache[slots], k_new[flat]])
            values = torch.cat([v_cache[slots], v_new[flat]])
            want = _plain(q[r * rows + node].unsqueeze(0), keys, values)
            torch.testing.assert_close(out[r * rows + node].unsqueeze(0), want, rtol=1e-5, atol=1e-5)
    assert branching > 0, "the trees under test must branch"


@pytest.mark.parametrize(("causal", "what"), [(True, "target chain"), (False, "drafter block")])
def test_without_a_mask_the_layer_causality_decides(causal, what):
    prefix_lens, rows = [5, 9], 6
    k_cache, v_cache, req_to_token, idx = _pool(prefix_lens, 7)
    q, k_new, v_new = _random_rows(len(prefix_lens), rows, 7)
    out = verify.verify_attention(
        q, k_new, v_new, k_cache, v_cache, req_to_token, idx, torch.tensor(prefix_lens),
        custom_mask=None, causal=causal, scaling=None,
    )  # fmt: skip
    for r, prefix in enumerate(prefix_lens):
        span = slice(r * rows, (r + 1) * rows)
        slots = req_to_token[idx[r], :prefix].long()
        keys, values = torch.cat([k_cache[slots], k_new[span]]), torch.cat([v_cache[slots], v_new[span]])
        want = _plain(q[span], keys, values, causal=causal)
        torch.testing.assert_close(out[span], want, rtol=1e-5, atol=1e-5)


def test_a_mask_of_the_wrong_size_is_refused():
    prefix_lens, rows = [4], 3
    k_cache, v_cache, req_to_token, idx = _pool(prefix_lens, 1)
    q, k_new, v_new = _random_rows(1, rows, 1)
    with pytest.raises(ValueError, match="custom_mask holds"):
        verify.verify_attention(
            q, k_new, v_new, k_cache, v_cache, req_to_token, idx, torch.tensor(prefix_lens),
            custom_mask=torch.ones(rows * (4 + rows) + 1, dtype=torch.bool), causal=True, scaling=None,
        )  # fmt: skip
