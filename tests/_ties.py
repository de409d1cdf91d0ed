"""Greedy ties, shared by the CPU tests, the CUDA twins and the GPU identity tests.

1. A constructed exact tie of the target's logits (``tied_round``): SGLang's greedy sampler takes
   ``torch.argmax(logits, -1)``, the first (smallest) id among equal maxima, so at T = 0 DDTREE's walk
   must emit that id too, whether or not the tree holds the other tied id.
2. ``judge_greedy``: an identity test's verdict on one server's greedy answers against the plain
   server's. Where the tree verify's logits differ from decode's by rounding (bf16 logits of rows
   computed in another batch shape), the first difference of a prompt is accepted only where the plain
   server's own top-2 log-probs at that position lie within ``NEAR_TIE_LOGPROB_GAP`` and the other
   answer took the second one; every such position is counted and reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# One bf16 step of a logit in [8, 16): the most one rounding difference moves the lab pairs' bf16
# logits (the plain server printed -0.8069 for both of the pair the GPU suite split on).
NEAR_TIE_LOGPROB_GAP = 1 / 16


@dataclass(frozen=True)
class TiedRound:
    """Draft logits ``[1, 1, V]`` whose tree (budget 1) holds only the larger tied id ``hi`` and (budget
    2) both, and target logits ``[1, 3, V]`` where every row ties ``lo`` and ``hi`` for the maximum."""

    draft_logits: torch.Tensor
    target_logits: torch.Tensor
    lo: int
    hi: int


def tied_round(vocab: int, lo: int, hi: int, *, dtype: torch.dtype = torch.float32,
               device: str = "cpu") -> TiedRound:
    assert 0 <= lo < hi < vocab
    draft = torch.zeros(1, 1, vocab)
    draft[0, 0, hi], draft[0, 0, lo] = 10.0, 9.0  # the drafter ranks hi first: budget 1 holds hi only
    target = torch.zeros(1, 3, vocab)
    target[..., lo] = target[..., hi] = 5.0  # an exact tie in every dtype
    target[..., (lo + hi) // 2] = 4.0
    return TiedRound(draft.to(device), target.to(device=device, dtype=dtype), lo, hi)


def sglang_greedy(logits: torch.Tensor) -> torch.Tensor:
    """SGLang 0.5.23's greedy sampler (``Sampler.forward``, is_all_greedy): ``torch.argmax(logits, -1)``."""
    return torch.argmax(logits, -1)


# ---------------------------------------------------------------------------- identity with near-ties


@dataclass
class Verdict:
    prompts: int = 0
    identical: int = 0
    near_ties: list[dict[str, Any]] = field(default_factory=list)  # accepted first differences
    failures: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def figures(self) -> dict[str, Any]:
        return {"prompts": self.prompts, "identical": self.identical, "near_ties": len(self.near_ties),
                "near_tie_gap_max": max((t["gap"] for t in self.near_ties), default=None),
                "near_tie_bound": NEAR_TIE_LOGPROB_GAP}


def top2(doc: dict[str, Any], position: int) -> list[tuple[float, int]] | None:
    """The plain answer's two best (log-prob, id) at ``position`` (``top_logprobs_num`` >= 2)."""
    rows = (doc.get("meta_info") or {}).get("output_top_logprobs") or []
    if position >= len(rows) or not rows[position] or len(rows[position]) < 2:
        return None
    return [(float(e[0]), int(e[1])) for e in rows[position][:2]]


def judge_greedy(plain_docs: list[dict[str, Any]], got: list[list[int]], labels: list[str] | None = None,
                 *, bound: float = NEAR_TIE_LOGPROB_GAP) -> Verdict:
    """Per prompt: identical, or a first difference at a near-tie of the plain server's own top-2
    (then the rest is another context and is not compared), or a failure."""
    verdict = Verdict(prompts=len(got))
    for i, (doc, ids) in enumerate(zip(plain_docs, got, strict=True)):
        want = doc["output_ids"]
        label = labels[i] if labels else str(i)
        if ids == want:
            verdict.identical += 1
            continue
        pos = next((k for k, (a, b) in enumerate(zip(want, ids, strict=False)) if a != b), None)
        if pos is None:
            verdict.failures.append({"prompt": label, "why": f"lengths {len(want)} vs {len(ids)}"})
            continue
        best = top2(doc, pos)
        entry = {"prompt": label, "position": pos, "plain": want[pos], "got": ids[pos], "top2": best}
        if best is None:
            verdict.failures.append({**entry, "why": "no top-2 log-probs from the plain server there"})
            continue
        gap = best[0][0] - best[1][0]
        if gap <= bound and {want[pos], ids[pos]} == {best[0][1], best[1][1]}:
            verdict.near_ties.append({**entry, "gap": round(gap, 6)})
        else:
            verdict.failures.append({**entry, "gap": round(gap, 6), "why": f"not a near-tie (bound {bound})"})
    return verdict
