"""A reference simulation for counterfactual counters: the real scorer (core/counterfactual.py) fed by a
server that decodes with one setting, so every counter is one a real server could emit (no hand-written
numbers). Each request slot holds a target's greedy output; each round the drafter's per-depth logits
favour the true next tokens (more at shallow depths), the server's tree accepts what its greedy walk
accepts against that output (``match_depth``) and emits it plus the bonus token, before any stop cut, as
the lab engine feeds its walk. Requests end and new ones start in their slot (rounds discarded at release)."""

from __future__ import annotations

import torch

from ddtree_runtime.core.counterfactual import CounterfactualScorer, match_depth, parse_candidates
from ddtree_runtime.core.counterfactual_invariants import counts_from_snapshot
from ddtree_runtime.core.tree import build_tree


def simulate(
    seed: int,
    *,
    rounds: int = 240,
    slots: int = 4,
    horizon: int = 7,
    vocab: int = 10,
    candidates: str = "chain,4,8,16,32,64",
    running: str = "chain",
    fraction: float = 0.8,
    skill: float = 3.0,
    request_tokens: tuple[int, int] = (20, 60),
) -> dict:
    """Counts (the readers' format) after ``rounds`` decode rounds of ``slots`` requests at a time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    try:
        return _simulate(
            seed, rounds, slots, horizon, vocab, candidates, running, fraction, skill, request_tokens
        )
    finally:
        torch.set_num_threads(threads)


def _simulate(
    seed: int,
    rounds: int,
    slots: int,
    horizon: int,
    vocab: int,
    candidates: str,
    running: str,
    fraction: float,
    skill: float,
    request_tokens: tuple[int, int],
) -> dict:
    gen = torch.Generator().manual_seed(seed)
    cands = parse_candidates(candidates, horizon)
    run = next(c for c in cands if c.label == running)
    scorer = CounterfactualScorer(cands, horizon=horizon, num_slots=slots, device="cpu")
    length = lambda: int(torch.randint(request_tokens[0], request_tokens[1], (1,), generator=gen))  # noqa: E731
    # Each slot's output so far is long enough for any round (the walk's tokens past a request's end are
    # the target's all the same: the scorer sees the walk before the stop cut).
    outputs = [
        torch.randint(0, vocab, (request_tokens[1] + 2 * horizon + 2,), generator=gen) for _ in range(slots)
    ]
    ends = [length() for _ in range(slots)]
    pos = [0] * slots
    for _ in range(rounds):
        cont = torch.stack([outputs[s][pos[s] : pos[s] + horizon] for s in range(slots)])  # [b, L]
        logits = torch.randn(slots, horizon, vocab, generator=gen)
        strength = skill * torch.rand(slots, 1, generator=gen) * torch.linspace(1.0, 0.3, horizon)[None]
        logits.scatter_add_(2, cont[:, :, None], strength[:, :, None])
        tree = build_tree(logits, run.budget, topk_cap=run.topk_cap)
        accepted = match_depth(tree, cont)  # what the running setting's greedy walk accepts
        num = accepted + 1
        emitted = torch.stack([outputs[s][pos[s] : pos[s] + horizon + 1] for s in range(slots)])
        top = scorer.top_from_logits(logits)
        sample = torch.rand(slots, generator=gen) < fraction
        scorer.observe(top, emitted, num, torch.arange(slots), sample)
        for s in range(slots):
            pos[s] += int(num[s])
            if pos[s] >= ends[s]:  # the request ended: its pending rounds are discarded, a new one starts
                scorer.release(torch.tensor([s]))
                outputs[s] = torch.randint(0, vocab, outputs[s].shape, generator=gen)
                pos[s], ends[s] = 0, length()
    return counts_from_snapshot(scorer.snapshot())
