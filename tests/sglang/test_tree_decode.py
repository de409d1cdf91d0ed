"""The DDTREE tree decode round on SGLang's REAL pools (ReqToTokenPool, token-to-KV allocators,
MHATokenToKVPool on device cpu): KV commit for page sizes 1 and 16, hidden gather by node index,
stop tokens, batch > 1 with mixed prefixes, whole rounds against target-only greedy decoding.
Only the model is a toy (tests/sglang/_tree_decode_toy.py)."""

from __future__ import annotations

import pytest
import torch

from ddtree_runtime.core.tree import walk_posterior
from ddtree_runtime.sglang_plugin.round.tree_commit import accepted_moves, commit_accepted_kv, window_slots
from ddtree_runtime.sglang_plugin.round.tree_round import (
    RoundConfig,
    RoundInput,
    run_tree_round,
    truncate_at_stop,
)
from ddtree_runtime.sglang_plugin.round.tree_step import plan_tree_verify
from tests.sglang._tree_decode_toy import DTYPE, ToyModels, ToyTarget, make_pools

pytestmark = pytest.mark.sglang

BUDGET, BLOCK = 9, 5  # verify 10 rows, drafter horizon 4: budget and block decoupled
WINDOW = max(BUDGET + 1, BLOCK)


def _alloc_rows(allocator, req_to_token, rows: list[int], lengths: list[int], page_size: int) -> list[int]:
    """Give each request row ``length`` slots from the real allocator (page-rounded); returns the
    allocated lengths (what SGLang frees when the request finishes)."""
    allocated = []
    for row, n in zip(rows, lengths, strict=True):
        n = -(-n // page_size) * page_size
        slots = allocator.alloc(n)
        assert slots is not None
        req_to_token[row, :n] = slots.to(req_to_token.dtype)
        allocated.append(n)
    return allocated


def _finish(allocator, req_to_token, rows: list[int], lengths: list[int]) -> None:
    """What SGLang does when requests finish: free each row's whole allocation."""
    allocator.free(torch.cat([req_to_token[row, :n].long() for row, n in zip(rows, lengths, strict=True)]))


def _fill_kv(kv_pool, slots: torch.Tensor) -> None:
    """Distinct K/V per slot (K = slot id, V = -slot id), so a read names the row it came from."""
    values = slots.to(DTYPE).view(-1, 1, 1).expand(-1, 1, kv_pool.head_dim).contiguous()
    kv_pool.set_kv_buffer(None, slots.long(), values, -values, layer_id_override=0)


def _deep_path(plan, r: int) -> list[int]:
    """The path to request r's deepest node (ties: highest index): not a prefix 1, 2, ... of the
    verify rows whenever the tree branches before it."""
    budget = plan.tree.tokens.shape[1]
    deep = max(range(1, budget + 1), key=lambda n: (int(plan.tree.depths[r, n - 1]), n))
    path = []
    while deep > 0:
        path.append(deep)
        deep = int(plan.tree.parents[r, deep])
    return path[::-1]


def _posterior_for(plan, paths: list[list[int]], bonus: int = 3) -> torch.Tensor:
    b, rows = plan.candidates.shape
    post = torch.full((b, rows), -7, dtype=torch.long)
    for r, path in enumerate(paths):
        cur = 0
        for n in path:
            post[r, cur] = plan.candidates[r, n]
            cur = n
        post[r, cur] = bonus
    return post


def _walk(prefix: list[int], seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(prefix), BLOCK - 1, 12, generator=g) * 1.5
    plan = plan_tree_verify(logits, torch.zeros(len(prefix), dtype=torch.long), torch.tensor(prefix), BUDGET)
    paths = [_deep_path(plan, r) for r in range(len(prefix))]
    return plan, paths, walk_posterior(plan.tree, _posterior_for(plan, paths))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("owned_per_round", [False, True], ids=["spec-v2 reservation", "per-round window"])
def test_commit_puts_accepted_kv_at_the_next_logical_rows(page_size, owned_per_round):
    prefix = [3, 21, 16]  # unaligned, unaligned, page-aligned (page 16)
    req_pool, allocator, kv, _ = make_pools(
        page_size=page_size, size=1024, head_dim=4, rows=4, context=96, draft_dim=4
    )
    r2t = req_pool.req_to_token
    rows = req_pool.alloc_rows(3)
    start = allocator.available_size()
    if owned_per_round:
        # the prefix is owned already; this round's window comes from the allocator (page-aligned end)
        allocated = _alloc_rows(allocator, r2t, rows, prefix, page_size)
        for i, row in enumerate(rows):
            n = -(-(prefix[i] + WINDOW) // page_size) * page_size - allocated[i]
            r2t[row, allocated[i] : allocated[i] + n] = allocator.alloc(n).to(r2t.dtype)
            allocated[i] += n
    else:  # spec-v2: the scheduler reserved the window with the prefix
        allocated = _alloc_rows(allocator, r2t, rows, [p + 2 * WINDOW for p in prefix], page_size)
    every = torch.cat([r2t[row, :n] for row, n in zip(rows, allocated, strict=True)])
    _fill_kv(kv, every)
    before = r2t.clone()
    _plan, paths, walk = _walk(prefix)

    commit = commit_accepted_kv(
        walk,
        slots=window_slots(r2t, torch.tensor(rows), torch.tensor(prefix), WINDOW),
        req_to_token=r2t,
        req_pool_indices=torch.tensor(rows),
        prefix_lens=torch.tensor(prefix),
        kv_pool=kv,
        page_size=page_size,
        release=allocator.free if owned_per_round else None,
    )

    keys = kv.get_key_buffer(0)[:, 0, 0]
    for r, row in enumerate(rows):
        nodes = [0, *paths[r]]
        assert paths[r] != list(range(1, len(paths[r]) + 1)), "the test needs a non-prefix path"
        want = [int(before[row, prefix[r] + n]) for n in nodes]  # the slot node n was verified in
        logical = r2t[row, prefix[r] : prefix[r] + len(nodes)].long()
        assert keys[logical].long().tolist() == want  # K at logical rows = the accepted nodes' rows
        assert commit.committed_slots[r, : len(nodes)].tolist() == logical.tolist()
        # every page size: the mapping is never rewritten (the row may have another owner by
        # now, under the overlap scheduler); the K/V rows moved instead
        assert torch.equal(r2t[row], before[row])
    assert commit.new_seq_lens.tolist() == [p + len(path) + 1 for p, path in zip(prefix, paths, strict=True)]
    assert commit.moved_rows == len(prefix) * BLOCK  # fixed shape: b * (L + 1) entries

    if owned_per_round:
        # rejected slots went back: page 1 exactly W - a per request; page 16 the whole pages past
        # the committed rows
        new_len = commit.new_seq_lens
        if page_size == 1:
            kept = sum(int(n) for n in new_len)
        else:
            kept = sum(-(-int(n) // page_size) * page_size for n in new_len)
        assert allocator.available_size() == start - kept
        owned = [r2t[row, : int(n)].long() for row, n in zip(rows, new_len, strict=True)]
        allocator.free(torch.cat(owned))
    else:
        # reservation: the window is still the request's (a permutation of the same slots) ...
        for row, n in zip(rows, allocated, strict=True):
            assert sorted(r2t[row, :n].tolist()) == sorted(before[row, :n].tolist())
        assert allocator.available_size() == start - sum(allocated)
        # ... and finishing the request (SGLang frees its whole allocation) returns every slot
        allocator.free(torch.cat([r2t[row, :n].long() for row, n in zip(rows, allocated, strict=True)]))
    assert allocator.available_size() == start  # exactly: nothing leaked, nothing freed twice


def test_accepted_moves_are_fixed_shape_and_move_only_displaced_nodes():
    acc = torch.tensor([[0, 2, 5, -1], [0, -1, -1, -1], [0, 1, 3, 4]])
    slots = torch.arange(100, 124).view(3, 8)
    dst, src = accepted_moves(acc, slots)
    assert dst.shape == src.shape == (12,)
    # node 2 -> row 1, node 5 -> row 2; staying nodes and padding are SGLang's dummy move 0 -> 0
    assert dst.view(3, 4).tolist() == [[0, 101, 102, 0], [0, 0, 0, 0], [0, 0, 118, 119]]
    assert src.view(3, 4).tolist() == [[0, 102, 105, 0], [0, 0, 0, 0], [0, 0, 119, 120]]


def _setup(prompts, *, page_size=1, noise=1.5, target_seed=0, rounds_room=64, depth_first=False):
    target = ToyTarget(seed=target_seed)
    req_pool, allocator, kv, draft_kv = make_pools(
        page_size=page_size,
        size=2048,
        head_dim=target.dim,
        rows=len(prompts) + 1,
        context=256,
        draft_dim=target.hidden_width,
    )
    start = allocator.available_size()
    rows = req_pool.alloc_rows(len(prompts))
    allocated = _alloc_rows(
        allocator, req_pool.req_to_token, rows, [len(p) + rounds_room for p in prompts], page_size
    )
    models = ToyModels(target, req_pool.req_to_token, kv, draft_kv, noise=noise)
    bonus = [models.prefill(row, p) for row, p in zip(rows, prompts, strict=True)]
    cfg = RoundConfig(
        budget=BUDGET, block_size=BLOCK, mask_token_id=11, page_size=page_size, depth_first=depth_first
    )
    return target, models, rows, allocated, allocator, start, bonus, cfg, kv


def _decode(prompts, n_tokens, *, page_size=1, stop=None, temperatures=None, noise=1.5, depth_first=False):
    _target, models, rows, allocated, allocator, start, bonus, cfg, kv = _setup(
        prompts, page_size=page_size, noise=noise, depth_first=depth_first
    )
    r2t = models.req_to_token
    out = [[b] for b in bonus]
    prefix = [len(p) for p in prompts]
    live = list(range(len(prompts)))
    rounds = []
    while live:
        inp = RoundInput(
            req_pool_indices=torch.tensor([rows[r] for r in live]),
            prefix_lens=torch.tensor([prefix[r] for r in live]),
            bonus_tokens=torch.tensor([out[r][-1] for r in live]),
            temperatures=None if temperatures is None else torch.tensor([temperatures[r] for r in live]),
            stop_token_ids=None if stop is None else tuple(frozenset(stop) for _ in live),
        )
        res = run_tree_round(models, inp, cfg, req_to_token=r2t, kv_pool=kv)
        rounds.append((list(live), res))
        still = []
        for i, r in enumerate(live):
            n = int(res.commit_lens[i])
            out[r].extend(res.out_tokens[i, :n].tolist())
            prefix[r] = int(res.new_seq_lens[i])
            if not bool(res.finished[i]) and len(out[r]) < n_tokens:
                still.append(r)
        live = still
    return out, rounds, models, (allocator, start, rows, allocated), prefix


@pytest.mark.parametrize("depth_first", [False, True], ids=["heap", "depth_first"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_tree_rounds_reproduce_target_greedy_for_a_mixed_batch(page_size, depth_first):
    prompts = [[1, 4, 2], [5, 3, 3, 7, 0, 9, 2], [8, 1, 6, 6, 2, 0, 4, 10, 3, 5, 7, 1]]
    out, rounds, models, (allocator, start, rows, allocated), lens = _decode(
        prompts, 24, page_size=page_size, depth_first=depth_first
    )
    if depth_first:  # the rows really were reordered: every first child right after its parent
        from ddtree_runtime.core.tree_order import depth_first_order

        for _, res in rounds:
            parents = res.plan.tree.parents
            assert torch.equal(depth_first_order(parents), torch.arange(parents.shape[1]).expand_as(parents))
    target = models.target
    for p, got in zip(prompts, out, strict=True):
        want = target.reference_greedy(p, len(got))
        assert got == want  # lossless: the tree round emits the target's own greedy tokens
    accepted = torch.cat([res.accept_length for _, res in rounds]).float()
    assert accepted.mean() > 0.5, "the toy drafter should get drafts accepted"
    # the tree mattered: some accepted path left the first-child spine
    off_spine = any(
        any(n != k for k, n in enumerate(res.accept.walk.accepted[i].tolist()) if n >= 0)
        for _, res in rounds
        for i in range(res.accept.walk.accepted.shape[0])
    )
    assert off_spine
    # committed KV rows read back the full token sequence (prompt + emitted but the last bonus)
    for r, (p, got) in enumerate(zip(prompts, out, strict=True)):
        seq = p + got[:-1]
        assert lens[r] == len(seq)
        slots = models.req_to_token[rows[r], : len(seq)].long()
        hidden = models.draft_kv.get_key_buffer(0)[slots, 0]
        assert target.token_of(hidden, torch.arange(len(seq))).tolist() == seq
    # the request finishes: SGLang frees its whole row, the allocator is back exactly
    _finish(allocator, models.req_to_token, rows, allocated)
    assert allocator.available_size() == start


def test_drafter_gets_hidden_states_by_node_index_at_consecutive_positions():
    prompts = [[2, 7, 1, 4], [9, 9, 3]]
    _, rounds, models, _, _ = _decode(prompts, 14)
    checked = 0
    for live, res in rounds:
        rows = res.plan.draft_token_num
        for i in range(len(live)):
            acc = [n for n in res.accept.walk.accepted[i].tolist() if n >= 0]
            # the rows handed over are the accepted NODES of request i, root first
            mine = res.draft_context_rows[i, : int(res.commit_lens[i])]
            assert mine.tolist() == [i * rows + n for n in acc]
            checked += acc != list(range(len(acc)))
    assert checked > 0, "some round must accept a path that is not the verify rows' prefix"
    # what the drafter read back each round is exactly the committed sequence
    for (live, res), contexts in zip(rounds[1:], models.draft_contexts[1:], strict=True):
        for i, ctx in enumerate(contexts):
            assert len(ctx) == int(res.plan.positions.view(len(live), -1)[i, 0])


def test_a_stop_token_inside_the_accepted_path_truncates_the_round():
    prompts = [[1, 4, 2, 8], [5, 3, 3]]
    free_run, rounds, *_ = _decode(prompts, 30)
    _, first = rounds[0]
    # a stop token at emitted position 1 of a round that accepted at least two tokens
    r = max(range(2), key=lambda i: int(first.commit_lens[i]))
    n = int(first.commit_lens[r])
    assert n >= 3, "the toy needs a round that accepts two drafts"
    emitted = first.out_tokens[r, :n].tolist()
    stop = emitted[1]
    assert stop not in emitted[:1]
    out, rounds, models, (allocator, start, rows, allocated), _lens = _decode(prompts, 30, stop=[stop])
    _, res = rounds[0]
    assert res.out_tokens[r, :2].tolist() == emitted[:2] and int(res.commit_lens[r]) == 2
    assert bool(res.finished[r]) and (res.out_tokens[r, 2:] == -1).all()
    assert int(res.new_seq_lens[r]) == len(prompts[r]) + 2  # only the rows before the stop commit
    assert out[r][-1] == stop and out[r][1:] == free_run[r][1 : len(out[r])]
    _finish(allocator, models.req_to_token, rows, allocated)
    assert allocator.available_size() == start


def test_truncate_at_stop_keeps_requests_without_a_stop():
    _plan, _paths, walk = _walk([4, 6])
    first = int(walk.emitted[0, 0])
    cut, finished = truncate_at_stop(walk, (frozenset({first}), frozenset()))
    assert finished.tolist() == [True, False]
    assert int(cut.num_emitted[0]) == 1 and int(cut.bonus[0]) == first
    assert cut.accepted[0].tolist()[1:] == [-1] * (cut.accepted.shape[1] - 1)
    assert torch.equal(cut.emitted[1], walk.emitted[1]) and torch.equal(cut.accepted[1], walk.accepted[1])


@pytest.mark.parametrize("depth_first", [False, True], ids=["heap", "depth_first"])
def test_sampled_rounds_commit_consistent_kv_and_tokens(depth_first):
    """T > 0 walks through walk_sample; whatever is sampled, the committed KV must read back the
    emitted sequence (the losslessness of walk_sample itself is tested in tests/unit)."""
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    out, _rounds, models, (_, _, rows, _), _lens = _decode(
        prompts, 16, temperatures=[0.8, 0.0], depth_first=depth_first
    )
    target = models.target
    assert out[1] == target.reference_greedy(prompts[1], len(out[1]))  # the T = 0 row stays greedy
    for r, (p, got) in enumerate(zip(prompts, out, strict=True)):
        seq = p + got[:-1]
        slots = models.req_to_token[rows[r], : len(seq)].long()
        assert (
            target.token_of(models.draft_kv.get_key_buffer(0)[slots, 0], torch.arange(len(seq))).tolist()
            == seq
        )


def test_the_hidden_guard_runs_after_the_verify_forward():
    from ddtree_runtime.core.contract import HiddenContract
    from ddtree_runtime.core.model_files import ContractError

    target, models, rows, _, _, _, bonus, cfg, kv = _setup([[1, 2, 3]])
    inp = RoundInput(
        req_pool_indices=torch.tensor(rows), prefix_lens=torch.tensor([3]), bonus_tokens=torch.tensor(bonus)
    )
    models.hidden_override = None
    contract = HiddenContract(
        target_hidden_size=target.dim,
        target_num_layers=4,
        target_layer_ids=(1, 2),
        block_size=BLOCK,
        draft_hidden_size=8,
        fc_in_features=2 * target.dim,
        mask_token_id=11,
        hybrid=False,
    )
    seen = []
    run_tree_round(
        models,
        inp,
        cfg,
        req_to_token=models.req_to_token,
        kv_pool=kv,
        contract=contract,
        on_hidden=seen.append,
    )
    assert seen[-1].shape == (BUDGET + 1, 2 * target.dim)
    models.hidden_override = torch.zeros(BUDGET + 1, target.dim)  # [N, H] where [N, 2H] is due
    with pytest.raises(ContractError) as exc:
        run_tree_round(models, inp, cfg, req_to_token=models.req_to_token, kv_pool=kv, contract=contract)
    assert exc.value.cause == "hidden_width_mismatch"
    models.hidden_override = None
    real = models.target_verify
    models.target_verify = lambda plan, loc, idx: (real(plan, loc, idx)[0], None)
    with pytest.raises(ContractError) as exc:
        run_tree_round(models, inp, cfg, req_to_token=models.req_to_token, kv_pool=kv)
    assert exc.value.cause == "hidden_states_missing"


def test_processed_probs_apply_temperature_top_k_and_top_p():
    from ddtree_runtime.sglang_plugin.round.tree_round import processed_probs

    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]])).repeat(3, 1, 1)
    probs = processed_probs(
        logits,
        torch.tensor([1.0, 1.0, 1.0]),
        top_ks=torch.tensor([2, 0, 4]),
        top_ps=torch.tensor([1.0, 0.7, 1.0]),
    )
    assert probs[0, 0].tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])  # top-2
    assert probs[1, 0].tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])  # top-p 0.7 keeps 0.5 + 0.3
    assert probs[2, 0].tolist() == pytest.approx([0.5, 0.3, 0.15, 0.05])
    hot = processed_probs(logits[:1], torch.tensor([0.25]))
    sharp = torch.tensor([0.5, 0.3, 0.15, 0.05]) ** 4  # T = 1/4: p^4, renormalised
    assert hot[0, 0].tolist() == pytest.approx((sharp / sharp.sum()).tolist())


def test_sampled_walk_emits_the_targets_own_distribution():
    """T > 0 is lossless: over many independent rounds on one tree, the first emitted token follows
    the target's processed distribution at the root, and the second, given an accepted first
    node, the distribution at that node's row (chi-square, fixed seed)."""
    from ddtree_runtime.sglang_plugin.round.tree_round import processed_probs, walk_round

    n, vocab = 6000, 6
    g = torch.Generator().manual_seed(11)
    draft = torch.randn(1, 3, vocab, generator=g)
    plan = plan_tree_verify(draft.repeat(n, 1, 1), torch.zeros(n, dtype=torch.long), torch.zeros(n), 5)
    target = torch.randn(1, 6, vocab, generator=g).repeat(n, 1, 1)
    temps = torch.full((n,), 0.9)
    walk = walk_round(plan, target.reshape(n * 6, vocab), temps, generator=torch.Generator().manual_seed(2))
    law = processed_probs(target[:1], temps[:1])[0]

    def chi2(samples: torch.Tensor, p: torch.Tensor) -> float:
        counts = torch.bincount(samples, minlength=vocab).double()
        expected = p.double() * samples.numel()
        live = expected > 0
        assert counts[~live].sum() == 0
        return float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())

    assert chi2(walk.emitted[:, 0], law[0]) < 20.5  # 5 dof, p = 0.001
    child = int(plan.retrieve_next_token[0, 0])  # the root's first child
    took = walk.accepted[:, 1] == child
    assert int(took.sum()) > 300
    assert chi2(walk.emitted[took, 1], law[child]) < 20.5


def _truncate_reference(emitted: list[int], num: int, stops: frozenset[int]) -> int:
    for k, tok in enumerate(emitted[:num]):
        if tok in stops:
            return k + 1
    return num


def test_truncate_at_stop_cuts_at_the_first_stop_of_each_request_like_reading_its_tokens():
    """The on-device cut against the plain per-request scan, on random walks and stop sets (stops
    anywhere, several per request, none, in the padding, repeated)."""
    from ddtree_runtime.core.tree_types import WalkResult

    gen = torch.Generator().manual_seed(5)
    for _ in range(40):
        b, width = 5, 7
        num = torch.randint(1, width + 1, (b,), generator=gen)
        emitted = torch.randint(0, 12, (b, width), generator=gen)
        emitted = torch.where(torch.arange(width) < num.unsqueeze(1), emitted, -1)
        accepted = torch.where(emitted >= 0, torch.arange(width).expand(b, -1), -1)
        walk = WalkResult(accepted=accepted, num_accepted=num.clone(), bonus=emitted[:, 0], emitted=emitted,
                          num_emitted=num.clone(), tree_rows=accepted)  # fmt: skip
        stops = tuple(frozenset(torch.randint(0, 14, (int(k),), generator=gen).tolist())
                      for k in torch.randint(0, 4, (b,), generator=gen))  # fmt: skip
        cut, finished = truncate_at_stop(walk, stops)
        for r in range(b):
            want = _truncate_reference(emitted[r].tolist(), int(num[r]), stops[r])
            stopped = any(tok in stops[r] for tok in emitted[r, : int(num[r])].tolist())
            assert int(cut.num_emitted[r]) == want and bool(finished[r]) == stopped, (r, stops[r], emitted[r])
            assert cut.emitted[r, :want].tolist() == emitted[r, :want].tolist()
            assert (cut.emitted[r, want:] == -1).all() and int(cut.bonus[r]) == int(emitted[r, want - 1])
