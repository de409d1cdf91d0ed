"""Where the counterfactual estimate's bias comes from, offline on the lab engine (tiny real models, CPU).

The chain server's prediction of a tree budget's tokens per round ran low against servers running the budget
(H100 hybrid: -5.6 % at 16, -6.2 % at 32; the CPU lab: -3.4 %, -4.6 %). This script measures each candidate
cause with the truth known, and prints one JSON line per (pair, budget) plus a synthetic check.

How the truth is known: a lab engine that drafts at every position and accepts none of it (its tree is one
padded node: plain greedy decoding, lossless) records the drafter's logits rooted at EVERY output position.
Every tree the scorer builds at a position is then known, and so is what it accepts there against the
greedy output (``a_b(j)``): the budget-b server's rounds are the walk ``j -> j + a_b(j) + 1`` from the
first output token. The map is checked against real engines running each budget (the same accept lengths,
round by round, printed as ``map_matches_engine``).

Figures per budget b (``truth`` = tokens per round of the b server, all its rounds, as the engine counts):

* ``renewal_full``: the scorer's estimator, sum r / sum r / (a + 1), on every chain round with the
  continuation known in full (no request end): the estimator's own bias (cause a and b together);
* ``naive_full``: mean (a + 1) on the chain's rounds: the selection of the chain's round starts (cause b);
* ``own_positions``: mean (a + 1) on the b server's own round starts (= truth, a check) and ``all_positions``:
  over every position;
* ``renewal_scored`` / ``discarded``: the scorer as it runs (a request's end cuts the continuation; a round
  still matching at the end is discarded), cause c; ``renewal_window``: the same but counting a round
  only when its whole window (the deepest candidate's depth) is known, whatever it matched, and
  ``truth_window``: the b server's own rounds by the same rule (what its own scorer reports);
* ``scorer_engine``: what the real scorer inside a chain engine printed, to tie the simulation to it.

Per pair also one line per running setting (``"running"``): every setting predicting every other from its own
rounds, the renewal estimate's and the naive mean's error (full continuations).

Synthetic (``"pair": "synthetic"``): acceptance drawn independently per position (no memory): the renewal
weighting's harmonic mean against the truth.

Usage (about a minute on one core):
``PYTHONPATH=. .venv/bin/python scripts/bench/counterfactual_bias.py [--new 160] [--pairs dense,hybrid]``
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

import torch

from ddtree_runtime.core.counterfactual import Candidate, match_depth, parse_candidates
from ddtree_runtime.core.tree import build_tree
from ddtree_runtime.core.tree_types import DraftTree
from ddtree_runtime.tiny_engine import decoder as decoder_mod
from ddtree_runtime.tiny_engine.engine import SamplingParams, TinyEngine
from ddtree_runtime.tiny_engine.language import LAB_PROMPTS

HORIZON = 15
BUDGETS = (8, 16, 32, 64)


def _models(kind: str) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.unit._tiny_engine import lab_models

    return lab_models(kind)


Map = list[tuple[list[int], list[torch.Tensor]]]


def position_map(models: Path, prompts: list[list[int]], total: int) -> Map:
    """Per prompt: the greedy output (``total`` tokens) and the drafter's logits ``[L, V]`` rooted at each
    output position (index j: the round whose root is output j)."""
    real_build = decoder_mod.build_tree
    out = []
    for prompt in prompts:
        logs: list[torch.Tensor] = []

        def empty_tree(draft_logits: torch.Tensor, budget: int, *, topk_cap=None, logs=logs) -> DraftTree:
            logs.append(draft_logits[0].detach().clone())
            b, dev = draft_logits.shape[0], draft_logits.device
            return DraftTree(
                tokens=torch.full((b, 1), -1, dtype=torch.long, device=dev),
                depths=torch.zeros((b, 1), dtype=torch.long, device=dev),
                parents=torch.full((b, 2), -1, dtype=torch.long, device=dev),
                scores=torch.full((b, 1), float("-inf"), device=dev),
                num_nodes=torch.zeros((b,), dtype=torch.long, device=dev),
                horizon=int(draft_logits.shape[1]),
            )

        decoder_mod.build_tree = empty_tree
        try:
            eng = TinyEngine(models / "target", models / "draft", algorithm="DDTREE", budget=1)
            res = eng.generate([prompt], [SamplingParams(max_new_tokens=total, ignore_eos=True)])[0]
        finally:
            decoder_mod.build_tree = real_build
        assert all(k == 1 for k in res.accept_lengths), "a padded node was accepted"
        out.append((res.output_ids, logs))
    return out


def accept_map(output: list[int], logs: list[torch.Tensor], cands: list[Candidate]) -> dict[str, list[int]]:
    """a(j) per candidate: drafted tokens its tree at root j accepts against the output (full window where
    the output reaches; shorter at the end of the map)."""
    logits = torch.stack(logs)  # [J, L, V]
    out: dict[str, list[int]] = {}
    deepest = {}
    cont = torch.full((len(logs), HORIZON), -1, dtype=torch.long)
    for j in range(len(logs)):
        seg = output[j + 1 : j + 1 + HORIZON]
        cont[j, : len(seg)] = torch.tensor(seg, dtype=torch.long)
    for c in cands:
        tree = build_tree(logits, c.budget, topk_cap=c.topk_cap)
        out[c.label] = match_depth(tree, cont).tolist()
        deepest[c.label] = tree.depths.amax(dim=1).tolist()
    out["_max_depth"] = deepest  # type: ignore[assignment]
    return out


def walk(acc: list[int], n: int) -> list[int]:
    """Round roots of a server whose tree at root j accepts acc[j], for a request of n output tokens."""
    roots, j = [], 0
    while j + 1 < n:
        roots.append(j)
        j += acc[j] + 1
    return roots


def real_engine_taus(models: Path, prompts: list[list[int]], n: int, cand: Candidate) -> list[list[int]]:
    eng = TinyEngine(models / "target", models / "draft", algorithm="DDTREE", budget=cand.budget,
                     topk_cap=cand.topk_cap)  # fmt: skip
    res = eng.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True)] * len(prompts))
    return [r.accept_lengths for r in res]


def chain_engine_scorer(models: Path, prompts: list[list[int]], n: int, cands: list[Candidate]) -> dict:
    eng = TinyEngine(models / "target", models / "draft", algorithm="DDTREE", budget=HORIZON, topk_cap=1,
                     counterfactual=cands, counterfactual_fraction=1.0)  # fmt: skip
    eng.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True)] * len(prompts))
    snap = eng.counterfactual.snapshot()
    return {c["label"]: c["tokens_per_round"] for c in snap["candidates"]} | {
        "_scored": snap["rounds_scored"],
        "_discarded": snap["rounds_discarded"],
    }


def renewal(r: list[int], a: list[int]) -> float:
    return sum(r) / sum(ri / (ai + 1) for ri, ai in zip(r, a, strict=True)) if r else float("nan")


def by_previous(maps: list, roots_list: list[list[int]], prev: str, lab: str) -> dict[str, list]:
    """Candidate ``lab``'s tokens at each root but a request's first, by what the round before it emitted
    (1, 2, 3+ tokens) under setting ``prev`` (the server whose roots these are): [rounds, mean]."""
    cells: dict[str, list[int]] = {"1": [], "2": [], "3+": []}
    for (_, m), roots in zip(maps, roots_list, strict=True):
        for i in range(1, len(roots)):
            k = m[prev][roots[i - 1]] + 1
            cells["1" if k == 1 else "2" if k == 2 else "3+"].append(m[lab][roots[i]] + 1)
    return {k: [len(v), round(sum(v) / max(len(v), 1), 3)] for k, v in cells.items()}


def analyse(kind: str, new: int) -> None:
    models = _models(kind)
    cands = parse_candidates("chain,8,16,32,64", HORIZON)
    eng0 = TinyEngine(models / "target", models / "draft", algorithm="DFLASH")
    prompts = [eng0.tokenizer.encode(p) for p in LAB_PROMPTS]
    total = new + 2 * HORIZON + 2  # the windows of the last rounds complete, for the uncensored figures
    maps = []
    for output, logs in position_map(models, prompts, total):
        maps.append((output, accept_map(output, logs, cands)))
    # The map against real engines: each budget's accept lengths, round by round.
    matches = {}
    for c in cands:
        taus = real_engine_taus(models, prompts, new, c)
        sim = [[m[c.label][j] + 1 for j in walk(m[c.label], new)] for _, m in maps]
        matches[c.label] = taus == sim
    cross(kind, maps, new, [c.label for c in cands])
    scorer = chain_engine_scorer(models, prompts, new, cands)
    chain_roots = [walk(m["chain"], new) for _, m in maps]
    for c in cands[1:]:
        lab = c.label
        own = [walk(m[lab], new) for _, m in maps]
        truth_taus = [m[lab][j] + 1 for (_, m), roots in zip(maps, own, strict=True) for j in roots]
        truth = sum(truth_taus) / len(truth_taus)
        r_full = [m["chain"][j] + 1 for (_, m), roots in zip(maps, chain_roots, strict=True) for j in roots]
        a_full = [m[lab][j] for (_, m), roots in zip(maps, chain_roots, strict=True) for j in roots]
        all_pos = [m[lab][j] + 1 for _, m in maps for j in range(new - 1)]
        # The scorer as it runs: the continuation ends with the request (output index new - 1).
        r_s, a_s, r_w, a_w, disc = [], [], [], [], 0
        for (_, m), roots in zip(maps, chain_roots, strict=True):
            end = roots[-1] + m["chain"][roots[-1]] + 1  # the last round's tokens all reach the scorer
            for j in roots:
                known = min(end - 1 - j, HORIZON)
                deepest = max(m["_max_depth"][x.label][j] for x in cands)
                final = all(min(m[x.label][j], known) < known or known >= m["_max_depth"][x.label][j]
                            for x in cands)  # fmt: skip
                r = min(m["chain"][j], known) + 1
                if final:
                    r_s.append(r)
                    a_s.append(min(m[lab][j], known))
                else:
                    disc += 1
                if known >= deepest:
                    r_w.append(r)
                    a_w.append(m[lab][j])
        # Snapped walk: the tree's own walk over the chain's rounds, landing on the first chain round at or
        # past where its round would end (one trajectory per request: fewer samples).
        snap_taus = []
        for (_, m), roots in zip(maps, chain_roots, strict=True):
            nxt = 0
            for j in roots:
                if j >= nxt:
                    snap_taus.append(m[lab][j] + 1)
                    nxt = j + m[lab][j] + 1
        # What a root follows: the tree's acceptance at a root, by how many tokens the round before it
        # emitted (1, 2, 3+), at the chain's roots (previous round the chain's) and at the tree's own.
        stratified = {"chain_roots": by_previous(maps, chain_roots, "chain", lab),
                      "own_roots": by_previous(maps, own, lab, lab)}  # fmt: skip
        own_w = [m[lab][j] + 1 for (_, m), roots in zip(maps, own, strict=True) for j in roots
                 if new - 1 - j >= max(m["_max_depth"][x.label][j] for x in cands)]  # fmt: skip
        print(json.dumps({
            "pair": kind, "new_tokens": new, "budget": lab, "truth": round(truth, 4),
            "truth_rounds": len(truth_taus), "chain_rounds": len(r_full),
            "renewal_full": round(renewal(r_full, a_full), 4),
            "renewal_full_err_pct": round(100 * (renewal(r_full, a_full) / truth - 1), 2),
            "naive_full": round(sum(a + 1 for a in a_full) / len(a_full), 4),
            "naive_full_err_pct": round(100 * (sum(a + 1 for a in a_full) / len(a_full) / truth - 1), 2),
            "all_positions": round(sum(all_pos) / len(all_pos), 4),
            "all_positions_harmonic": round(len(all_pos) / sum(1 / t for t in all_pos), 4),
            "renewal_scored": round(renewal(r_s, a_s), 4),
            "renewal_scored_err_pct": round(100 * (renewal(r_s, a_s) / truth - 1), 2),
            "scored": len(r_s), "discarded": disc,
            "renewal_window": round(renewal(r_w, a_w), 4),
            "truth_window": round(sum(own_w) / len(own_w), 4),
            "renewal_window_err_pct": round(100 * (renewal(r_w, a_w) / (sum(own_w) / len(own_w)) - 1), 2),
            "renewal_window_vs_truth_pct": round(100 * (renewal(r_w, a_w) / truth - 1), 2),
            "snapped_walk": round(sum(snap_taus) / len(snap_taus), 4), "snapped_rounds": len(snap_taus),
            "snapped_walk_err_pct": round(100 * (sum(snap_taus) / len(snap_taus) / truth - 1), 2),
            "tau_by_previous_round_n_mean": stratified,
            "scorer_engine": round(scorer[lab], 4),
            "scorer_engine_err_pct": round(100 * (scorer[lab] / truth - 1), 2),
            "scorer_engine_scored": scorer["_scored"], "scorer_engine_discarded": scorer["_discarded"],
            "map_matches_engine": matches[lab], "chain_map_matches_engine": matches["chain"],
        }), flush=True)  # fmt: skip


def cross(kind: str, maps: list, new: int, labels: list[str]) -> None:
    """Every setting predicting every other from its own rounds (full continuations): the renewal
    estimate's and the naive mean's error, per (running, candidate)."""
    truth = {}
    for lab in labels:
        taus = [m[lab][j] + 1 for _, m in maps for j in walk(m[lab], new)]
        truth[lab] = sum(taus) / len(taus)
    for running in labels:
        roots = [walk(m[running], new) for _, m in maps]
        r = [m[running][j] + 1 for (_, m), rr in zip(maps, roots, strict=True) for j in rr]
        row: dict[str, dict[str, float]] = {"renewal_err_pct": {}, "naive_err_pct": {}}
        for lab in labels:
            a = [m[lab][j] for (_, m), rr in zip(maps, roots, strict=True) for j in rr]
            row["renewal_err_pct"][lab] = round(100 * (renewal(r, a) / truth[lab] - 1), 1)
            row["naive_err_pct"][lab] = round(100 * ((sum(a) / len(a) + 1) / truth[lab] - 1), 1)
        print(json.dumps({"pair": kind, "new_tokens": new, "running": running, **row}), flush=True)


def synthetic(seed: int = 0, positions: int = 200_000) -> None:
    """Memoryless acceptance: a_b(j) independent per position (a chain accepting geometric(p_c), a tree
    geometric(p_t) but never less than the chain, same position). The renewal weighting assumes a's
    constant over the chain round's span; here it is not at all."""
    rng = random.Random(seed)
    for p_chain, p_tree in ((0.5, 0.7), (0.5, 0.8), (0.6, 0.85)):
        chain, tree = [], []
        for _ in range(positions):
            u = rng.random()
            # coupled: the same uniform drives both geometric draws, so tree >= chain at each position
            c = int(math.log(1 - u) / math.log(p_chain)) if u > 0 else 0
            t = int(math.log(1 - u) / math.log(p_tree)) if u > 0 else 0
            chain.append(min(c, HORIZON))
            tree.append(min(max(t, c), HORIZON))
        own = walk(tree, positions)
        truth = sum(tree[j] + 1 for j in own) / len(own)
        roots = walk(chain, positions)
        r = [chain[j] + 1 for j in roots]
        a = [tree[j] for j in roots]
        est = renewal(r, a)
        naive = sum(x + 1 for x in a) / len(a)
        print(json.dumps({"pair": "synthetic", "p_chain": p_chain, "p_tree": p_tree, "truth": round(truth, 4),
                          "renewal": round(est, 4), "renewal_err_pct": round(100 * (est / truth - 1), 2),
                          "naive": round(naive, 4), "naive_err_pct": round(100 * (naive / truth - 1), 2)}),
              flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new", type=int, default=160)
    ap.add_argument("--pairs", default="dense,hybrid")
    args = ap.parse_args()
    torch.set_num_threads(1)
    synthetic()
    for kind in args.pairs.split(","):
        analyse(kind, args.new)


if __name__ == "__main__":
    main()
