"""Counterfactual acceptance (core/counterfactual.py): per round exact against the tree the real round
builds and the greedy walk over it, with tokens arriving over several rounds, ties, the chain, and the
ring's bookkeeping (dropped, discarded)."""

from __future__ import annotations

import pytest
import torch

from ddtree_runtime.core.counterfactual import (
    Candidate,
    CounterfactualScorer,
    match_depth,
    parse_candidates,
)
from ddtree_runtime.core.tree import build_tree, walk_greedy, walk_posterior

L, V = 6, 5  # a small vocabulary: trees branch, continuations often match deep


def _logits(seed: int, b: int, ties: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, L, V, generator=g) * 2.5
    if ties:  # whole-number logits in a narrow range: many exact ties for the stable order to break
        x = torch.randint(0, 3, (b, L, V), generator=g).float()
    return x


def _brute_depth(tree, row: int, cont: list[int]) -> int:
    """Walk node by node in Python: the child of the current node holding the next token."""
    tokens, parents = tree.tokens[row].tolist(), tree.parents[row].tolist()
    cur, depth = 0, 0
    for t in cont:
        nxt = [i + 1 for i, tok in enumerate(tokens) if parents[i + 1] == cur and tok == t]
        if not nxt:
            break
        cur, depth = nxt[0], depth + 1
    return depth


def _target_logits_following(tree, cont: torch.Tensor) -> torch.Tensor:
    """Target logits [b, B+1, V] whose argmax at each node is the continuation's next token: the
    target of a T = 0 request whose output after the root is ``cont``."""
    b = tree.tokens.shape[0]
    depth = torch.cat([torch.zeros(b, 1, dtype=torch.long), tree.depths], 1).clamp(max=L - 1)
    nxt = cont.gather(1, depth)
    return torch.nn.functional.one_hot(nxt, V).float() * 5.0


CANDS = [Candidate(2), Candidate(4), Candidate(8), Candidate(16), Candidate(L, 1), Candidate(8, 2)]


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_each_round_matches_the_real_tree_and_its_greedy_walk(seed: int, ties: bool) -> None:
    b = 4
    logits = _logits(seed, b, ties)
    g = torch.Generator().manual_seed(100 + seed)
    # Continuations that follow the draft's argmax for a random stretch, then go astray.
    cont = torch.randint(0, V, (b, L), generator=g)
    follow = torch.randint(0, L + 1, (b,), generator=g)
    argmax = logits.argmax(-1)
    cont = torch.where(torch.arange(L)[None] < follow[:, None], argmax, cont)

    scorer = CounterfactualScorer(CANDS, horizon=L, num_slots=b, device="cpu")
    top = scorer.top_from_logits(logits)
    for cand, tree_cf in zip(CANDS, scorer.trees(top), strict=True):
        real = build_tree(logits, cand.budget, topk_cap=cand.topk_cap)  # what the round would build
        for field in ("tokens", "depths", "parents"):
            assert torch.equal(getattr(real, field), getattr(tree_cf, field)), (cand, field)
        walked = walk_greedy(real, _target_logits_following(real, cont)).num_accepted - 1
        assert torch.equal(match_depth(real, cont), walked)
        posterior = cont.gather(
            1, torch.cat([torch.zeros(b, 1, dtype=torch.long), real.depths], 1).clamp(max=L - 1)
        )
        assert torch.equal(walk_posterior(real, posterior).num_accepted - 1, walked)
        assert walked.tolist() == [_brute_depth(real, i, cont[i].tolist()) for i in range(b)]

    # The same continuation arriving over several rounds (1..3 tokens each), one row at a time so
    # the counters are per round.
    for i in range(b):
        s = CounterfactualScorer(CANDS, horizon=L, num_slots=1)
        slot = torch.tensor([0])
        row_top = s.top_from_logits(logits[i : i + 1])
        pieces, at = [], 0
        while at < L:
            k = int(torch.randint(1, 4, (1,), generator=g))
            pieces.append(cont[i, at : at + k])
            at += k
        for j, piece in enumerate(pieces):
            emitted = torch.full((1, 4), -1, dtype=torch.long)
            emitted[0, : piece.numel()] = piece
            s.observe(
                row_top if j == 0 else None,
                emitted,
                torch.tensor([piece.numel()]),
                slot,
                torch.tensor([True]) if j == 0 else None,
            )
        snap = s.snapshot()
        assert snap["rounds_scored"] == 1 and snap["pending"] == 0
        want = [
            _brute_depth(build_tree(logits[i : i + 1], c.budget, topk_cap=c.topk_cap), 0, cont[i].tolist())
            for c in CANDS
        ]
        assert [c["accepted"] for c in snap["candidates"]] == want
        assert [c["accepted_sq"] for c in snap["candidates"]] == [w * w for w in want]


def test_the_chain_is_the_draft_argmax_prefix() -> None:
    logits = _logits(7, 3)
    argmax = logits.argmax(-1)
    cont = argmax.clone()
    cont[0, 2] = (cont[0, 2] + 1) % V  # row 0 leaves the chain at depth 3, row 1 never, row 2 at once
    cont[2, 0] = (cont[2, 0] + 1) % V
    s = CounterfactualScorer([Candidate(L, 1)], horizon=L, num_slots=3)
    tree = s.trees(s.top_from_logits(logits))[0]
    assert torch.equal(tree.tokens, argmax) and match_depth(tree, cont).tolist() == [2, L, 0]


def test_a_round_resolves_as_soon_as_every_candidate_has_missed() -> None:
    logits = _logits(3, 1)
    argmax = logits.argmax(-1)[0]
    s = CounterfactualScorer([Candidate(L, 1), Candidate(4)], horizon=L, num_slots=1)
    top = s.top_from_logits(logits)
    miss = torch.tensor([[(int(argmax[0]) + 1) % V]])
    # A first token off the chain: the chain's count (0) is final, but budget 4 may hold that token.
    tree4 = s.trees(top)[1]
    s.observe(top, miss, torch.tensor([1]), torch.tensor([0]), torch.tensor([True]))
    has_it = bool(((tree4.depths[0] == 1) & (tree4.tokens[0] == miss[0, 0])).any())
    assert s.snapshot()["rounds_scored"] == (0 if has_it else 1)


def test_unresolved_rounds_are_discarded_at_release_and_a_full_ring_drops() -> None:
    logits = _logits(1, 1)
    argmax = logits.argmax(-1)
    s = CounterfactualScorer([Candidate(L, 1)], horizon=L, num_slots=2, ring=1)
    top = s.top_from_logits(logits)
    slot, yes = torch.tensor([0]), torch.tensor([True])
    s.observe(top, argmax[:, :1], torch.tensor([1]), slot, yes)  # matches so far: pending
    s.observe(top, argmax[:, 1:2], torch.tensor([1]), slot, yes)  # ring of 1 is full: dropped
    snap = s.snapshot()
    assert (snap["rounds_sampled"], snap["rounds_dropped"], snap["pending"]) == (2, 1, 1)
    s.release(slot)
    snap = s.snapshot()
    assert (snap["rounds_discarded"], snap["pending"], snap["rounds_scored"]) == (1, 0, 0)
    # An unsampled row registers nothing; the other slot is untouched by slot 0's tokens.
    s.observe(top, argmax[:, :1], torch.tensor([1]), torch.tensor([1]), torch.tensor([False]))
    assert s.snapshot()["pending"] == 0 and s.snapshot()["rounds_sampled"] == 2


def test_slots_in_one_batch_keep_their_own_continuations() -> None:
    logits = _logits(11, 2)
    argmax = logits.argmax(-1)
    s = CounterfactualScorer([Candidate(L, 1)], horizon=L, num_slots=5)
    slots = torch.tensor([4, 1])
    emitted = torch.stack([argmax[0], (argmax[1] + 1) % V])  # slot 4 follows its chain, slot 1 misses
    s.observe(s.top_from_logits(logits), emitted, torch.tensor([L, L]), slots, torch.tensor([True, True]))
    snap = s.snapshot()
    assert snap["rounds_scored"] == 2 and snap["candidates"][0]["accepted"] == L


def test_bad_input_is_refused_with_a_reason() -> None:
    assert parse_candidates("8, 16,chain", 15) == [Candidate(8), Candidate(16), Candidate(15, 1)]
    for spec, words in [("", "no candidate"), ("8,x", "'x'"), ("8,8", "twice"), ("0", "1..")]:
        with pytest.raises(ValueError, match=words):
            parse_candidates(spec, 15)
    with pytest.raises(ValueError, match="horizon"):
        CounterfactualScorer([Candidate(4)], horizon=0, num_slots=1)
    s = CounterfactualScorer([Candidate(4)], horizon=L, num_slots=1)
    top = s.top_from_logits(torch.randn(1, L + 1, V))
    with pytest.raises(ValueError, match="horizon"):
        s.observe(
            top,
            torch.zeros(1, 1, dtype=torch.long),
            torch.tensor([1]),
            torch.tensor([0]),
            torch.tensor([True]),
        )


def test_renewal_weighting_counts_each_real_round_for_the_tokens_it_covered() -> None:
    # Two rounds of one request on a server running the chain: round 1 emits 3 tokens (2 accepted +
    # bonus), round 2 emits 1 (0 + bonus). A candidate accepting m1 and m2 on them would need
    # 3 / (m1 + 1) + 1 / (m2 + 1) rounds for those 4 positions.
    logits = _logits(5, 1)
    argmax = logits.argmax(-1)
    cands = [Candidate(L, 1), Candidate(16)]
    s = CounterfactualScorer(cands, horizon=L, num_slots=1)
    top = s.top_from_logits(logits)
    slot, yes = torch.tensor([0]), torch.tensor([True])
    off = (argmax + 1) % V
    first = torch.cat([argmax[0, :2], off[0, 2:]])  # the chain leaves at depth 3; the rest is known too
    second = off[0]
    s.observe(top, first[None], torch.tensor([3]), slot, yes)
    s.observe(None, first[None, 3:], torch.tensor([L - 3]), slot, None)  # the rest of round 1's window
    s.observe(top, second[None], torch.tensor([1]), slot, yes)
    s.observe(None, second[None, 1:], torch.tensor([L - 1]), slot, None)
    snap = s.snapshot()
    assert (snap["rounds_scored"], snap["real_emitted"], snap["real_emitted_sq"]) == (2, 4, 3 * 3 + 1 * 1)
    tree16 = build_tree(logits, 16)
    m = [_brute_depth(tree16, 0, first.tolist()), _brute_depth(tree16, 0, second.tolist())]
    chain, tree = snap["candidates"]
    assert chain["accepted"] == 2 and chain["round_weight"] == pytest.approx(3 / 3 + 1 / 1)
    assert chain["tokens_per_round"] == pytest.approx(
        2.0
    )  # the running setting: its real 4 tokens / 2 rounds
    assert chain["accepted_x_real"] == 2 * 3 + 0 * 1
    assert tree["accepted"] == sum(m) and tree["accepted_x_real"] == m[0] * 3 + m[1] * 1
    assert tree["round_weight"] == pytest.approx(3 / (m[0] + 1) + 1 / (m[1] + 1))


def test_a_round_cut_at_a_stop_token_never_scores_the_running_setting_off_by_its_cut() -> None:
    # The server runs the chain (depth L). Its walk accepted all L drafted tokens, the L-th a stop token:
    # the round is cut there (the bonus dropped), so it emitted L tokens, not L + 1. Reaching the chain's
    # deepest node would make the count final; paired with the cut count it is one token off.
    logits = _logits(13, 1)
    path = logits.argmax(-1)
    slot, yes = torch.tensor([0]), torch.tensor([True])

    def run(ends: torch.Tensor | None) -> dict:
        s = CounterfactualScorer([Candidate(L, 1)], horizon=L, num_slots=1)
        s.observe(s.top_from_logits(logits), path, torch.tensor([L]), slot, yes, ends)
        return s.snapshot()

    snap = run(torch.tensor([True]))
    assert (snap["rounds_scored"], snap["rounds_discarded"], snap["pending"]) == (0, 1, 0)
    # Told nothing, the scorer cannot know the round was cut: scored, accepted + 1 != real tokens.
    snap = run(None)
    assert snap["rounds_scored"] == 1 and snap["candidates"][0]["accepted"] + 1 == snap["real_emitted"] + 1


def test_a_request_riding_a_round_after_its_stop_feeds_nothing_to_its_pending_rounds() -> None:
    # Running the chain, a round cut at a stop token at depth 2 (it emitted 2 tokens of a walk that went
    # on); under an overlap scheduler the finished request rides one more round, whose tokens continue
    # the chain's path. Fed to the cut round, they would score it L accepted against 2 real tokens.
    logits = _logits(17, 1)
    path = logits.argmax(-1)
    slot, yes, no = torch.tensor([0]), torch.tensor([True]), torch.tensor([False])
    for ends, scored, discarded in ((torch.tensor([True]), 0, 1), (None, 1, 0)):
        s = CounterfactualScorer([Candidate(L, 1), Candidate(16)], horizon=L, num_slots=1)
        s.observe(s.top_from_logits(logits), path[:, :2], torch.tensor([2]), slot, yes, ends)
        s.observe(None, path[:, 2:], torch.tensor([L - 2]), slot, no)  # the ride after the stop
        snap = s.snapshot()
        assert (snap["rounds_scored"], snap["rounds_discarded"], snap["pending"]) == (scored, discarded, 0)
        chain = snap["candidates"][0]
        # accepted + rounds == real tokens holds only when the cut round is left out
        assert (chain["accepted"] + snap["rounds_scored"] == snap["real_emitted"]) == (ends is not None)


def test_a_row_that_ends_still_scores_what_its_miss_settled() -> None:
    # A stop token as the bonus (the round not cut): the running chain missed at depth 3, final by the
    # miss, scored exactly; an earlier round on the same slot settled by these tokens scores too.
    logits = _logits(19, 1)
    path = logits.argmax(-1)
    off = (path + 1) % V
    slot, yes = torch.tensor([0]), torch.tensor([True])
    s = CounterfactualScorer([Candidate(L, 1)], horizon=L, num_slots=1)
    top = s.top_from_logits(logits)
    emitted = torch.cat([path[:, :2], off[:, 2:3]], 1)
    s.observe(top, emitted, torch.tensor([3]), slot, yes, torch.tensor([True]))
    snap = s.snapshot()
    assert (snap["rounds_scored"], snap["rounds_discarded"], snap["real_emitted"]) == (1, 0, 3)
    assert snap["candidates"][0]["accepted"] == 2
