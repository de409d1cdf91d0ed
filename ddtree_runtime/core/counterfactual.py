"""Counterfactual acceptance: what each candidate tree budget would have accepted on this traffic.

A round's drafter distribution (``DraftTopK [b, L, K]``) is in the worker whatever it decodes with.
For a sampled round we build the tree every candidate (budget, top-k cap) would have built from it,
with the same builder the real round uses (``build_tree_from_topk``), and keep the trees in a small
ring per request slot. The target's tokens that follow the round's root arrive as the request's own
output over this and the next rounds; at T = 0 they are exactly what the target's greedy walk of any
tree would have followed (lossless decoding emits the target's greedy continuation whatever the tree).
A candidate accepts the deepest node whose root path equals that continuation's prefix.

A pending round is *resolved* when every candidate's count is known: a candidate's count is final once
the continuation holds a token it failed to match (``match < known``), or once ``known`` reaches the
tree's deepest node. Only resolved rounds are counted, and all candidates on the same rounds, so the
budgets compare on one sample. A round whose request ends before it resolves is discarded (counted as
such); a sampled round that finds its slot's ring full is dropped (counted). Each round emits at least
one token, so a ring of ``L`` entries per slot never fills even when every round is sampled.

Everything stays on the device of the inputs with fixed shapes: no host sync, nothing read back until
:meth:`CounterfactualScorer.snapshot` (the metrics scrape). Bounded memory:
``slots x ring x (candidates x max budget x 3 + L)`` int64.

Imports nothing of ours outside ``core``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ddtree_runtime.core.decoder_settings import MAX_BUDGET
from ddtree_runtime.core.tree import build_tree_from_topk, topk_log_probs
from ddtree_runtime.core.tree_types import DraftTopK, DraftTree

__all__ = [
    "DEFAULT_BUDGETS",
    "DEFAULT_FRACTION",
    "Candidate",
    "CounterfactualScorer",
    "CounterfactualSettings",
    "match_depth",
    "parse_candidates",
]

# The servers' defaults (the lab engine's flags and the SGLang plugin's): one greedy round in 20 scored
# (~400 rounds per 8k rounds served), for the budgets `ddtree tune` weighs and the chain.
DEFAULT_BUDGETS = "8,16,32,64,chain"
DEFAULT_FRACTION = 0.05


@dataclass(frozen=True)
class Candidate:
    """One setting to score: a node budget and a top-k cap (cap 1 = the chain, DFlash's own decode)."""

    budget: int
    topk_cap: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int) or not 1 <= self.budget <= MAX_BUDGET:
            raise ValueError(f"candidate budget must be an integer in 1..{MAX_BUDGET}, got {self.budget!r}")
        if self.topk_cap is not None and (not isinstance(self.topk_cap, int) or self.topk_cap < 1):
            raise ValueError(f"candidate top-k cap must be an integer >= 1 or None, got {self.topk_cap!r}")

    @property
    def is_chain(self) -> bool:
        return self.topk_cap == 1

    @property
    def label(self) -> str:
        """The metric label: ``chain``, ``16``, or ``16/cap4`` for a capped tree."""
        if self.is_chain:
            return "chain"
        return str(self.budget) if self.topk_cap is None else f"{self.budget}/cap{self.topk_cap}"


def parse_candidates(spec: str | Iterable[str], horizon: int) -> list[Candidate]:
    """``"8,16,32,64,chain"`` -> candidates; ``chain`` is budget ``horizon`` with top-k cap 1.

    Raises ValueError naming the bad item (empty list, not a number, duplicates).
    """
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec)]
    items = [s for s in items if s]
    if not items:
        raise ValueError("no candidate budgets given (expected e.g. 8,16,32,64,chain)")
    if horizon < 1:
        raise ValueError(f"draft horizon must be >= 1, got {horizon}")
    out: list[Candidate] = []
    for item in items:
        if item.lower() == "chain":
            cand = Candidate(horizon, 1)
        else:
            try:
                budget = int(item)
            except ValueError:
                raise ValueError(f"candidate budget {item!r} is neither an integer nor 'chain'") from None
            cand = Candidate(budget)
        if cand in out:
            raise ValueError(f"candidate {item!r} given twice")
        out.append(cand)
    return out


@dataclass(frozen=True)
class CounterfactualSettings:
    """What a server scores: the fraction of greedy decode rounds (0: off) and the candidates, resolved
    against the drafter's horizon. :meth:`resolve` is the one check of the two flags; ValueError names
    the flag, the value and the rule."""

    fraction: float
    budgets: str
    candidates: tuple[Candidate, ...]

    @classmethod
    def resolve(cls, fraction: float, budgets: str, horizon: int) -> CounterfactualSettings:
        if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0.0 <= fraction <= 1.0:
            # NaN fails the range too
            raise ValueError(
                "--speculative-ddtree-counterfactual-fraction must be a number in [0, 1] (0 turns scoring "
                f"off), got {fraction!r}"
            )
        try:
            candidates = parse_candidates(budgets, horizon)
        except ValueError as exc:
            raise ValueError(
                f"--speculative-ddtree-counterfactual-budgets {ascii(budgets)[:80]}: {exc} "
                f"(e.g. {DEFAULT_BUDGETS})"
            ) from None
        return cls(float(fraction), budgets, tuple(candidates))

    @property
    def enabled(self) -> bool:
        return self.fraction > 0.0


def match_depth(tree: DraftTree, continuation: Tensor) -> Tensor:
    """Drafted tokens the tree accepts against the target's continuation after its root.

    ``continuation [b, L']`` holds the target's tokens at depths 1..L' (-1 = not known yet, never
    matched). Returns ``[b]`` int64: the depth of the deepest node whose root path equals the
    continuation's prefix (siblings are distinct, so that path is unique). Equal to
    ``walk_posterior(tree, posterior).num_accepted - 1`` where ``posterior`` at each node is the
    continuation's next token, i.e. the greedy walk when the target's argmax follows ``continuation``.
    """
    return _match(tree.tokens, tree.depths, tree.parents[:, 1:] - 1, continuation)


def _match(tokens: Tensor, depths: Tensor, parents: Tensor, continuation: Tensor) -> Tensor:
    """``tokens/depths/parents [..., M]`` (parents: local node index, -1 = the root; padded nodes have
    depth 0), ``continuation [..., L']`` -> ``[...]`` matched depth. Pointer jumping: log2(L) steps."""
    width = continuation.shape[-1]
    real = depths > 0
    at = (depths - 1).clamp(min=0, max=max(width - 1, 0))
    want = continuation.gather(-1, at) if width else torch.full_like(tokens, -1)
    ok = real & (depths <= width) & (tokens == want) & (tokens >= 0)
    anc = parents.clone()
    # After step s, ok[i] covers i and its 2^s - 1 nearest ancestors; L <= 2^steps covers every path.
    steps = max(int(tokens.shape[-1]).bit_length(), 1)
    for _ in range(steps):
        has = anc >= 0
        safe = anc.clamp(min=0)
        ok = ok & torch.where(has, ok.gather(-1, safe), torch.ones_like(ok))
        anc = torch.where(has, anc.gather(-1, safe), anc)
    return torch.where(ok, depths, torch.zeros_like(depths)).amax(dim=-1)


class CounterfactualScorer:
    """Pending rounds per request slot, scored as their continuation arrives (see module doc).

    ``observe`` once per decode round for the requests in the batch, ``release`` when a slot's
    request ends, ``snapshot`` to read the counters (the only host sync).
    """

    def __init__(
        self,
        candidates: Sequence[Candidate],
        *,
        horizon: int,
        num_slots: int,
        ring: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if not candidates:
            raise ValueError("at least one candidate budget is needed")
        if len(set(candidates)) != len(candidates):
            raise ValueError("candidate budgets must be distinct")
        if horizon < 1:
            raise ValueError(f"draft horizon must be >= 1, got {horizon}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        ring = horizon if ring is None else int(ring)
        if ring < 1:
            raise ValueError(f"ring must be >= 1, got {ring}")
        self.candidates = list(candidates)
        self.horizon, self.num_slots, self.ring = int(horizon), int(num_slots), ring
        self.device = torch.device(device)
        s, r, c = self.num_slots, ring, len(self.candidates)
        m = max(cand.budget for cand in self.candidates)
        self.max_budget = m
        long = dict(dtype=torch.long, device=self.device)
        self.tokens = torch.full((s, r, c, m), -1, **long)
        self.depths = torch.zeros((s, r, c, m), **long)
        self.parents = torch.full((s, r, c, m), -1, **long)
        self.max_depth = torch.zeros((s, r, c), **long)
        self.cont = torch.full((s, r, self.horizon), -1, **long)  # the deepest a tree reaches
        self.known = torch.zeros((s, r), **long)
        self.real_tokens = torch.zeros((s, r), **long)  # tokens the real round emitted (accepted + 1)
        self.active = torch.zeros((s, r), dtype=torch.bool, device=self.device)
        # Counters (device): rounds scored, accepted drafted tokens and their squares per candidate.
        self.rounds_scored = torch.zeros((), **long)
        self.accepted = torch.zeros((c,), **long)
        self.accepted_sq = torch.zeros((c,), **long)
        self.rounds_sampled = torch.zeros((), **long)
        self.rounds_dropped = torch.zeros((), **long)
        self.rounds_discarded = torch.zeros((), **long)
        # Renewal weighting (see snapshot): tokens the scored real rounds emitted, and per candidate
        # the sum of (real tokens / candidate tokens), in fp64 (exact for any realistic count).
        self.real_emitted = torch.zeros((), **long)
        self.round_weight = torch.zeros((c,), dtype=torch.float64, device=self.device)
        # For the spread of a candidate against the running setting on the same rounds (paired):
        # sum of real tokens squared, and per candidate sum of accepted x real tokens.
        self.real_emitted_sq = torch.zeros((), **long)
        self.accepted_x_real = torch.zeros((c,), **long)

    # ------------------------------------------------------------------ per round

    def trees(self, top: DraftTopK) -> list[DraftTree]:
        """Each candidate's tree from this round's distributions: the builder the real round runs."""
        return [build_tree_from_topk(top, c.budget, topk_cap=c.topk_cap) for c in self.candidates]

    def top_from_logits(self, draft_logits: Tensor) -> DraftTopK:
        """The top-K the widest candidate needs, from full draft logits ``[b, L, V]`` (the lab engine's
        path: ``stable_topk`` reads a count back to the host; the plugin's head hands a DraftTopK)."""
        k = min(self.max_budget, int(draft_logits.shape[-1]))
        lp, ids = topk_log_probs(draft_logits, k)
        return DraftTopK(lp, ids, torch.logsumexp(draft_logits.float(), dim=-1))

    @torch.no_grad()
    def observe(
        self,
        top: DraftTopK | None,
        emitted: Tensor,
        num_emitted: Tensor,
        slots: Tensor,
        sample: Tensor | None,
        ends: Tensor | None = None,
    ) -> None:
        """One decode round of the batch rows ``slots [b]``.

        ``top`` is this round's drafter top-K ``[b, L, K]`` (rooted at the token before ``emitted``),
        with K >= min(widest candidate's budget, V): a head that ranks fewer (a budget-16 server's)
        would give the wider candidates narrower trees than they build. ``slots`` are distinct.
        ``sample [b]`` bool says which rows' rounds to score (None or ``top`` None: none);
        ``emitted [b, >=1]`` / ``num_emitted [b]`` are the target's tokens this round committed, in
        order. New pending rounds are registered before the tokens are fed: this round's own emitted
        tokens are the first of their continuation.

        ``ends [b]`` bool (None: none) marks rows whose request stops with this round (a stop token among
        its emitted tokens). A round cut at a stop token emitted fewer tokens than its walk accepted, and
        what a request rides on after its stop (an overlap scheduler's next round) is not its output: so
        on such a row a count is final only on a miss (``match < known``, not by reaching the tree's
        deepest node), and the slot's rounds still pending after this round are discarded (counted).
        """
        slots = slots.to(self.device).long()
        if top is not None and sample is not None:
            if top.ids.shape[1] != self.horizon:
                raise ValueError(f"draft top-K horizon {top.ids.shape[1]} != scorer horizon {self.horizon}")
            self._register(top, slots, sample.to(self.device).bool(), num_emitted.to(self.device).long())
        self._feed(emitted.to(self.device).long(), num_emitted.to(self.device).long(), slots)
        self._resolve(slots, None if ends is None else ends.to(self.device).bool())

    @torch.no_grad()
    def release(self, slots: Tensor) -> None:
        """The requests in ``slots`` ended: their unresolved rounds are discarded (and counted)."""
        slots = slots.to(self.device).long()
        self.rounds_discarded += self.active[slots].sum()
        self.active.index_fill_(0, slots, False)  # `[slots] = False` copies a host scalar: a sync

    def _register(self, top: DraftTopK, slots: Tensor, sample: Tensor, num_emitted: Tensor) -> None:
        b = slots.shape[0]
        trees = self.trees(top)
        m, c = self.max_budget, len(self.candidates)
        tok = torch.full((b, c, m), -1, dtype=torch.long, device=self.device)
        dep = torch.zeros((b, c, m), dtype=torch.long, device=self.device)
        par = torch.full((b, c, m), -1, dtype=torch.long, device=self.device)
        for j, t in enumerate(trees):
            n = t.budget
            tok[:, j, :n] = t.tokens
            dep[:, j, :n] = t.depths
            par[:, j, :n] = torch.where(t.parents[:, 1:] >= 0, t.parents[:, 1:] - 1, -1)
        free = ~self.active[slots]  # [b, R]
        has_free = free.any(dim=1)
        entry = free.long().argmax(dim=1)  # first free ring entry
        take = sample & has_free
        self.rounds_sampled += sample.sum()
        self.rounds_dropped += (sample & ~has_free).sum()
        # Rows not taken write into their slot's entry unchanged (a no-op), keeping shapes fixed.
        keep = take[:, None, None]
        old = (self.tokens[slots, entry], self.depths[slots, entry], self.parents[slots, entry])
        self.tokens[slots, entry] = torch.where(keep, tok, old[0])
        self.depths[slots, entry] = torch.where(keep, dep, old[1])
        self.parents[slots, entry] = torch.where(keep, par, old[2])
        self.max_depth[slots, entry] = torch.where(
            take[:, None], dep.amax(dim=-1), self.max_depth[slots, entry]
        )
        self.cont[slots, entry] = torch.where(take[:, None], -1, self.cont[slots, entry])
        self.known[slots, entry] = torch.where(take, 0, self.known[slots, entry])
        self.real_tokens[slots, entry] = torch.where(take, num_emitted, self.real_tokens[slots, entry])
        self.active[slots, entry] = self.active[slots, entry] | take

    def _feed(self, emitted: Tensor, num: Tensor, slots: Tensor) -> None:
        b, n = emitted.shape
        width = self.cont.shape[-1]
        known = self.known[slots]  # [b, R]
        cont = self.cont[slots]  # [b, R, W]
        pos = known[:, :, None] + torch.arange(n, device=self.device)[None, None]  # [b, R, n]
        valid = (torch.arange(n, device=self.device)[None, None] < num[:, None, None]) & (pos < width)
        valid = valid & self.active[slots][:, :, None]
        dump = torch.full_like(pos, width)  # writes past the window or off the mask land in a dump column
        padded = torch.cat([cont, torch.full_like(cont[..., :1], -1)], dim=-1)
        padded.scatter_(-1, torch.where(valid, pos, dump), emitted[:, None, :].expand(b, self.ring, n))
        self.cont[slots] = padded[..., :width]
        self.known[slots] = torch.where(self.active[slots], (known + num[:, None]).clamp(max=width), known)

    def _resolve(self, slots: Tensor, ends: Tensor | None) -> None:
        """Score the batch's pending rounds whose counts are final (only these slots got tokens); on rows
        that ``ends``, only a miss is final and what stays pending is discarded (see :meth:`observe`)."""
        c = len(self.candidates)
        cont = self.cont[slots][:, :, None, :].expand(-1, -1, c, -1)
        match = _match(self.tokens[slots], self.depths[slots], self.parents[slots], cont)  # [b, R, C]
        known = self.known[slots][:, :, None]
        deepest = known >= self.max_depth[slots]
        if ends is not None:  # a cut round's real count is short: its deepest match proves nothing
            deepest = deepest & ~ends[:, None, None]
        final = (match < known) | deepest
        active = self.active[slots]
        done = active & final.all(dim=-1)
        counted = torch.where(done[:, :, None], match, torch.zeros_like(match))
        self.rounds_scored += done.sum()
        self.accepted += counted.sum(dim=(0, 1))
        self.accepted_sq += (counted * counted).sum(dim=(0, 1))
        real = torch.where(done, self.real_tokens[slots], torch.zeros_like(done, dtype=torch.long))
        self.real_emitted += real.sum()
        self.real_emitted_sq += (real * real).sum()
        self.accepted_x_real += (counted * real[:, :, None]).sum(dim=(0, 1))
        self.round_weight += (real[:, :, None].double() / (match + 1).double()).sum(dim=(0, 1))
        left = active & ~done
        if ends is not None:
            self.rounds_discarded += (left & ends[:, None]).sum()
            left = left & ~ends[:, None]
        self.active[slots] = left

    # ------------------------------------------------------------------ read-out

    def snapshot(self) -> dict:
        """Host copy of the counters (the only host sync): ``{"rounds_scored", "rounds_sampled",
        "rounds_dropped", "rounds_discarded", "pending", "real_emitted", "real_emitted_sq",
        "candidates": [{"label", "budget", "topk_cap", "accepted", "accepted_sq", "round_weight",
        "accepted_x_real", "tokens_per_round"}]}``.

        ``accepted / rounds_scored`` is the candidate's mean acceptance on the rounds this server
        happened to start; a server running the candidate starts its rounds elsewhere (it skips what
        it accepts). ``tokens_per_round = real_emitted / round_weight`` corrects for that (renewal
        weighting: a real round that emitted ``n`` tokens stands for ``n`` positions, on which the
        candidate would need ``n / (accepted + 1)`` rounds), exact when the candidate's acceptance is
        constant over each real round's span (docs/counterfactual-acceptance.md).
        """
        return self.snapshot_from(self.counter_vector().tolist())

    def counter_vector(self) -> Tensor:
        """Every counter in one fp64 vector on the scorer's device, without a host read: a caller that
        must not sync copies it to the host asynchronously and reads it with :meth:`snapshot_from`. fp64
        holds the integer counts exactly below 2**53 (the readers refuse counts above it)."""
        scalars = [self.rounds_scored, self.rounds_sampled, self.rounds_dropped, self.rounds_discarded,
                   self.active.sum(), self.real_emitted, self.real_emitted_sq]  # fmt: skip
        per = [self.accepted, self.accepted_sq, self.round_weight, self.accepted_x_real]
        return torch.cat([torch.stack(scalars).double(), *(t.double() for t in per)])

    def snapshot_from(self, values: Sequence[float]) -> dict:
        """:meth:`snapshot`'s dict from a host copy of :meth:`counter_vector`."""
        c = len(self.candidates)
        if len(values) != _HEAD + 4 * c:
            raise ValueError(f"a counter vector of {len(values)} values; this scorer's holds {_HEAD + 4 * c}")
        head = [int(v) for v in values[:_HEAD]]
        acc, sq, weight, cross = (values[_HEAD + i * c : _HEAD + (i + 1) * c] for i in range(4))
        real = head[5]
        return {
            "rounds_scored": head[0],
            "rounds_sampled": head[1],
            "rounds_dropped": head[2],
            "rounds_discarded": head[3],
            "pending": head[4],
            "real_emitted": real,
            "real_emitted_sq": head[6],
            "candidates": [
                {
                    "label": cand.label,
                    "budget": cand.budget,
                    "topk_cap": cand.topk_cap,
                    "accepted": int(a),
                    "accepted_sq": int(q),
                    "round_weight": float(w),
                    "accepted_x_real": int(x),
                    "tokens_per_round": real / w if w > 0 else None,
                }
                for cand, a, q, w, x in zip(self.candidates, acc, sq, weight, cross, strict=True)
            ],
        }


_HEAD = 7  # counter_vector's scalars before the per-candidate blocks
