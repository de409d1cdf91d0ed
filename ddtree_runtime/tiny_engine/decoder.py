"""The tiny engine's decoder: the tiny models plus one decoding algorithm (autoregressive, DFlash chain or
DDTree), run one round at a time over a batch with a KV cache; greedy and T > 0.

The speculative round is the real one: draft block [bonus, MASK x L] -> draft logits -> tree
(`ddtree_runtime.core.tree.build_tree`; DFlash = the argmax chain) -> one target forward over root +
nodes with ancestor-only visibility -> contract guard on the captured hidden states -> walk (greedy or the
lossless sampling walk) -> `commit_plan` moves the accepted K/V rows -> the accepted rows' features feed
the drafter.

Hybrid targets (GDN + attention, ``model_config.TargetConfig.is_hybrid``): the verify runs the GDN layers
over the tree by parent pointer (every node from its parent's recurrent state), and after the walk each
request keeps the state of its last accepted node (``KVCache.commit_recurrent``); prefill keeps the last
prompt token's.

Which requests the rounds run, and when they end, is ``engine``'s (continuous batching).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ddtree_runtime.core.contract import HiddenContract, load_contract
from ddtree_runtime.core.counterfactual import Candidate, CounterfactualScorer
from ddtree_runtime.core.hidden_states import check_hidden_states
from ddtree_runtime.core.model_files import ContractError
from ddtree_runtime.core.tree import (
    DraftTree,
    build_tree,
    commit_plan,
    compile_tree,
    walk_greedy,
    walk_sample,
)
from ddtree_runtime.tiny_engine import faults as lab_faults
from ddtree_runtime.tiny_engine.faults import ENGINE_FAULTS as FAULTS
from ddtree_runtime.tiny_engine.kv_cache import KVCache
from ddtree_runtime.tiny_engine.models import load_draft, load_target
from ddtree_runtime.tiny_engine.server_args import LAB_DEFAULT_BUDGET
from ddtree_runtime.tiny_engine.tokenizer import TinyTokenizer

ALGORITHMS = ("NONE", "DFLASH", "DDTREE")


class HiddenStateError(RuntimeError):
    """The target's captured hidden states break the drafter's contract (SGLang's wording + ours)."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingParams:
        """SGLang's sampling_params; raises ValueError naming the bad field."""
        d = dict(d or {})
        unknown = sorted(set(d) - set(cls.__dataclass_fields__) - _IGNORED_SAMPLING_KEYS)
        if unknown:
            raise ValueError(f"Unknown sampling parameter(s): {', '.join(unknown)}")
        d = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        if "stop_token_ids" in d:
            d["stop_token_ids"] = tuple(int(t) for t in (d["stop_token_ids"] or ()))
        params = cls(**d)
        if not isinstance(params.max_new_tokens, int) or params.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative integer, got {params.max_new_tokens!r}")
        if not isinstance(params.temperature, int | float) or params.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {params.temperature!r}")
        if not 0 < params.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {params.top_p!r}")
        if params.top_k == 0 or params.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or at least 1, got {params.top_k!r}")
        return params

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


_IGNORED_SAMPLING_KEYS = {"min_new_tokens", "repetition_penalty", "frequency_penalty", "presence_penalty",
                          "stop", "skip_special_tokens", "n", "min_p", "no_stop_trim"}  # fmt: skip


@dataclass
class EngineStats:
    verify_ct: int = 0
    accepted_sum: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    observed_hidden_width: int | None = None
    hidden_missing: bool = False
    last_accept_length: float = 0.0


class TinyDecoder:
    """The lab models plus one decoding algorithm (NONE = autoregressive, DFLASH, DDTREE), one round at a
    time. Speculative decoders load the hidden-state contract first and guard every target forward with it
    (`HiddenStateError` carries SGLang's wording and the contract's)."""

    def __init__(
        self,
        target_dir: str | Path,
        draft_dir: str | Path | None = None,
        *,
        algorithm: str = "NONE",
        budget: int = LAB_DEFAULT_BUDGET,
        topk_cap: int | None = None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        fault: str | None = None,
        seed: int = 0,
        counterfactual: list[Candidate] | None = None,
        counterfactual_fraction: float = 0.0,
        counterfactual_slots: int = 64,
    ) -> None:
        algorithm = algorithm.upper()
        if algorithm not in ALGORITHMS:
            raise ValueError(f"Unknown speculative algorithm name: {algorithm}. Choose one of {ALGORITHMS}.")
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"unknown engine fault {fault!r}; choose one of {FAULTS}")
        self.algorithm, self.budget, self.topk_cap = algorithm, int(budget), topk_cap
        self.device, self.fault = torch.device(device), fault
        self.tokenizer = TinyTokenizer()
        self.target = load_target(target_dir, device=device, dtype=dtype)
        self.contract: HiddenContract | None = None
        self.draft = None
        if algorithm != "NONE":
            if draft_dir is None:
                raise ValueError(f"--speculative-draft-model-path is required for {algorithm}")
            # The contract first: a drafter made for another target fails here with the numbers.
            self.contract = _load_contract(target_dir, draft_dir)
            self.draft = load_draft(draft_dir, self.target.cfg.hidden_size, device=device, dtype=dtype)
            self.layer_ids = tuple(self.contract.target_layer_ids)
            self.block_size = int(self.contract.block_size)
            self.mask_id = int(self.contract.mask_token_id if self.contract.mask_token_id is not None else 0)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.stats = EngineStats()
        self.counterfactual: CounterfactualScorer | None = None
        self.counterfactual_fraction = float(counterfactual_fraction)
        if not 0.0 <= self.counterfactual_fraction <= 1.0:
            raise ValueError(f"counterfactual fraction must be in [0, 1], got {counterfactual_fraction!r}")
        if counterfactual and self.draft is not None and self.counterfactual_fraction > 0:
            # Slots: one per running request (a request finding none is not scored); its own sampler
            # so that scoring does not move the T > 0 walk's random stream.
            self.counterfactual = CounterfactualScorer(
                counterfactual,
                horizon=self.block_size - 1,
                num_slots=counterfactual_slots,
                device=self.device,
            )
            self._cf_free = list(range(counterfactual_slots))
            self._cf_generator = torch.Generator(device=self.device).manual_seed(seed + 1)
        # called after every decode round with (running requests, tokens held); the server logs from it
        self.on_round: Callable[[int, int], None] | None = None

    @property
    def num_draft_tokens(self) -> int:
        """SGLang's speculative_num_draft_tokens: tokens per verify row block."""
        if self.algorithm == "DDTREE":
            return self.budget + 1
        return self.block_size if self.algorithm == "DFLASH" else 1

    def new_draft_state(self, batch: int, capacity: int) -> DraftState:
        """The drafter's context cache for ``batch`` new requests of up to ``capacity`` rows each."""
        assert self.draft is not None
        return DraftState(self.draft, batch, capacity, self.target.lm_head.weight)

    # ------------------------------------------------------------------ rounds

    def _ar_round(self, cache: KVCache, lens: Tensor, roots: Tensor, params: list[SamplingParams]):
        b = lens.shape[0]
        span = int(lens.max()) + 1
        allowed = (torch.arange(span, device=self.device)[None] <= lens[:, None])[:, None, :]
        logits, _ = self._target_forward(
            roots[:, None], lens[:, None], allowed, cache, lens[:, None], torch.ones_like(lens), None
        )
        cache.commit_recurrent(torch.zeros_like(lens))
        nxt = self._decide(logits, params)
        return nxt, torch.ones(b, dtype=torch.long, device=self.device), lens + 1, logits

    def _spec_round(self, cache: KVCache, ds: DraftState, lens: Tensor, roots: Tensor, params, slots=None):
        draft_logits = ds.propose(lens, roots, self.target.model.embed_tokens, self.block_size, self.mask_id)
        if self.algorithm == "DDTREE":
            tree = build_tree(draft_logits, self.budget, topk_cap=self.topk_cap)
        else:
            tree = chain_tree(draft_logits)
        vin = compile_tree(tree, roots, lens)
        b, rows = vin.input_ids.shape
        span = int(lens.max()) + rows
        col = torch.arange(span, device=self.device)
        rel = col[None] - lens[:, None]  # [b, span] row relative to the prefix
        in_tree = (rel >= 0) & (rel < rows)
        vis = vin.visibility.gather(2, rel.clamp(0, rows - 1)[:, None, :].expand(b, rows, span))
        allowed = (rel < 0)[:, None, :] | (vis & in_tree[:, None, :])
        write_rows = lens[:, None] + torch.arange(rows, device=self.device)[None]
        counts = torch.full_like(lens, rows)
        logits, feats = self._target_forward(
            vin.input_ids, vin.positions, allowed, cache, write_rows, counts, "verify", parents=tree.parents
        )
        if all(p.greedy for p in params):
            walk_fn = lab_faults.relaxed_greedy_walk if self.fault == "relaxed_accept" else walk_greedy
            walk = walk_fn(tree, logits)
        else:
            walk = walk_sample(tree, self._probs(logits, params), generator=self.generator)
        cache.commit_recurrent(self._recurrent_commit_rows(walk))
        plan = commit_plan(walk, lens)
        src = torch.where(plan.src_loc >= 0, plan.src_loc, lens[:, None])
        dst = torch.where(plan.dst_loc >= 0, plan.dst_loc, lens[:, None])
        cache.move_rows(src, dst)
        acc = walk.accepted.clamp(min=0)
        ds.pending = (feats.gather(1, acc[:, :, None].expand(-1, -1, feats.shape[-1])), walk.num_accepted)
        if self.counterfactual is not None and slots is not None:
            self._score_counterfactual(draft_logits, walk, slots, params)
        self.stats.verify_ct += b
        self.stats.accepted_sum += int(walk.num_accepted.sum())
        self.stats.last_accept_length = float(walk.num_accepted.float().mean())
        # The verify row of each accepted node decided the token emitted after it (return_logprob).
        deciding = logits.gather(1, acc[:, :, None].expand(-1, -1, logits.shape[-1]))
        return walk.emitted, walk.num_emitted, plan.new_len, deciding

    def _score_counterfactual(self, draft_logits: Tensor, walk, slots: list[int | None], params) -> None:
        """Sampled greedy rounds: every candidate's tree from this round's draft, scored as the output
        arrives (core/counterfactual.py). T > 0 rows are not sampled (docs/counterfactual-acceptance.md)."""
        rows = [i for i, s in enumerate(slots) if s is not None]
        if not rows:
            return
        sel = torch.tensor(rows, device=self.device)
        draw = torch.rand(len(rows), generator=self._cf_generator, device=self.device)
        greedy = torch.tensor([params[i].greedy for i in rows], device=self.device)
        sample = (draw < self.counterfactual_fraction) & greedy
        slot_ids = torch.tensor([slots[i] for i in rows], device=self.device)
        # The lab engine syncs every round anyway: it skips the trees when no row is sampled and the
        # whole update when nothing is pending (the scorer itself never needs to).
        if bool(sample.any()):
            top = self.counterfactual.top_from_logits(draft_logits[sel])
            self.counterfactual.observe(top, walk.emitted[sel], walk.num_emitted[sel], slot_ids, sample)
        elif bool(self.counterfactual.active.any()):
            self.counterfactual.observe(None, walk.emitted[sel], walk.num_emitted[sel], slot_ids, None)

    def counterfactual_slot(self) -> int | None:
        """A free scorer slot for a new request (None: not scoring, or every slot taken)."""
        if self.counterfactual is None or not self._cf_free:
            return None
        return self._cf_free.pop()

    def release_counterfactual_slot(self, slot: int | None) -> None:
        if slot is None or self.counterfactual is None:
            return
        self.counterfactual.release(torch.tensor([slot], device=self.device))
        self._cf_free.append(slot)

    @staticmethod
    def _recurrent_commit_rows(walk) -> Tensor:
        """GDN layers: the verify row whose state each request keeps, its last accepted node. A tree
        node index: the accepted path is not a prefix of the rows, so ``num_accepted - 1`` (DFLASH's
        chain arithmetic) would be wrong here."""
        return walk.accepted.gather(1, (walk.num_accepted - 1)[:, None])[:, 0]

    # ------------------------------------------------------------------ target + guard

    def _target_forward(self, ids, positions, allowed, cache, rows, counts, phase: str | None, parents=None):
        """One target forward; with a drafter, the captured features pass the contract guard first.
        ``parents [b, n]``: the rows' tree (GDN layers of hybrid targets; default a chain)."""
        capture = self.layer_ids if (self.draft is not None and phase is not None) else ()
        logits, captured = self.target(
            ids, positions, allowed, cache=cache, rows=rows, capture_layer_ids=capture, parents=parents
        )
        if not capture:
            return logits, None
        n = ids.shape[1]
        feats: Tensor | None = torch.cat(captured, dim=-1)
        if self.fault == "capture_predicate":
            feats = captured[-1]  # the field bug: one layer's [N, H] instead of the k layers' [N, k*H]
        elif self.fault == "hidden_none":
            feats = None
        # Flat [N, width] over the real tokens, as SGLang hands it to the drafter.
        real = torch.arange(n, device=self.device)[None] < counts[:, None]
        flat = None if feats is None else feats[real]
        self._check_hidden(flat, phase, int(counts.sum()))
        return logits, feats

    def _check_hidden(self, hidden: Tensor | None, phase: str, num_tokens: int) -> None:
        assert self.contract is not None and self.draft is not None
        fc = self.draft.fc.weight
        try:
            check_hidden_states(
                hidden, self.contract, num_tokens=num_tokens, dtype=fc.dtype, device=fc.device
            )
        except ContractError as exc:
            self.stats.hidden_missing = hidden is None
            if hidden is not None and hidden.dim() == 2:
                self.stats.observed_hidden_width = int(hidden.shape[-1])
            message = f"{self._sglang_wording(hidden, phase, exc)} [ddtree contract, {exc.cause}: {exc}]"
            raise HiddenStateError(message, exc.cause) from exc
        self.stats.observed_hidden_width = int(hidden.shape[-1])

    def _sglang_wording(self, hidden: Tensor | None, phase: str, exc: ContractError) -> str:
        if hidden is None:
            if phase == "prefill":
                return "DFLASH requires target aux hidden capture for prefill, but got None."
            return "DFLASH verify requires target hidden states, but got None."
        return _dim_mismatch(self.contract, tuple(hidden.shape))

    # ------------------------------------------------------------------ sampling

    def _probs(self, logits: Tensor, params: list[SamplingParams]) -> Tensor:
        """Processed target probabilities [b, n, V] per request (temperature, top-k, top-p); greedy rows
        are one-hot, so one sampling walk serves a mixed batch exactly."""
        dev = logits.device
        logits = logits.float()
        greedy = torch.tensor([p.greedy for p in params], device=dev)
        temps = torch.tensor([1.0 if p.greedy else float(p.temperature) for p in params], device=dev)
        scaled = logits / temps[:, None, None]
        vocab = logits.shape[-1]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev).clamp(max=vocab)
        ordered = scaled.sort(dim=-1, descending=True).values
        kth = ordered.gather(-1, (top_k - 1)[:, None, None].expand(-1, scaled.shape[1], 1))
        probs = torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)
        top_p = torch.tensor([float(p.top_p) for p in params], device=dev)
        if bool((top_p < 1).any()):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop = (sorted_p.cumsum(-1) - sorted_p) > top_p[:, None, None]
            kept = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
            probs = kept / kept.sum(-1, keepdim=True)
        one_hot = torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()
        return torch.where(greedy[:, None, None], one_hot, probs)

    def _decide(self, logits: Tensor, params: list[SamplingParams]) -> Tensor:
        """Next token per row of logits [b, n, V] under each request's sampling params."""
        if all(p.greedy for p in params):
            return logits.argmax(-1)
        probs = self._probs(logits, params)
        b, n, v = probs.shape
        return torch.multinomial(probs.reshape(b * n, v), 1, generator=self.generator).reshape(b, n)


class DraftState:
    """The drafter's context K/V cache (projected target features of committed tokens, per layer)."""

    def __init__(self, draft, batch: int, capacity: int, lm_head_weight: Tensor) -> None:
        cfg = draft.cfg
        self.draft = draft
        self.cache = KVCache(
            cfg.num_hidden_layers, batch, cfg.num_key_value_heads, cfg.head_dim, capacity, lm_head_weight
        )
        self.lens = torch.zeros(batch, dtype=torch.long, device=lm_head_weight.device)
        self.lm_head_weight = lm_head_weight
        self.pending: tuple[Tensor, Tensor] | None = None  # (features [b, m, k*H], counts [b])

    def select(self, keep: Tensor) -> None:
        self.cache.select(keep)
        self.lens = self.lens[keep]
        if self.pending is not None:
            self.pending = (self.pending[0][keep], self.pending[1][keep])

    def extend(self, other: DraftState, capacity: int) -> None:
        """Append other's requests (rows); pending context features are padded to one width."""
        self.cache.extend(other.cache, capacity)
        self.lens = torch.cat([self.lens, other.lens])
        (fa, ca), (fb, cb) = self.pending, other.pending
        m = max(fa.shape[1], fb.shape[1])
        pad = lambda f: torch.nn.functional.pad(f, (0, 0, 0, m - f.shape[1]))  # noqa: E731
        self.pending = (torch.cat([pad(fa), pad(fb)]), torch.cat([ca, cb]))

    def propose(self, lens: Tensor, roots: Tensor, embed, block_size: int, mask_id: int) -> Tensor:
        """Append the pending context, run the block [root, MASK x L]; draft logits [b, L, V]."""
        feats, counts = self.pending
        b, m, _ = feats.shape
        positions = self.lens[:, None] + torch.arange(m, device=feats.device)[None]
        kv = self.draft.context_kv(self.draft.project(feats), positions)
        for i, (k, v) in enumerate(kv):
            self.cache.write(i, positions, k, v)
        self.lens = self.lens + counts
        self.pending = None
        if not torch.equal(self.lens, lens):
            raise RuntimeError(f"draft context {self.lens.tolist()} out of step with target {lens.tolist()}")
        span = int(self.lens.max())
        context = [self.cache.view(i, span) for i in range(len(kv))]
        valid = torch.arange(span, device=feats.device)[None] < self.lens[:, None]
        block = torch.full((b, block_size), mask_id, dtype=torch.long, device=feats.device)
        block[:, 0] = roots
        block_pos = lens[:, None] + torch.arange(block_size, device=feats.device)[None]
        hidden = self.draft(embed(block), block_pos, context, valid)
        return hidden[:, 1:] @ self.lm_head_weight.T


def chain_tree(draft_logits: Tensor) -> DraftTree:
    """DFlash: the draft's argmax at every depth, one chain of L nodes (node d at depth d)."""
    b, horizon, _ = draft_logits.shape
    logp = torch.log_softmax(draft_logits.float(), dim=-1)
    top, tokens = logp.max(dim=-1)
    dev = draft_logits.device
    depths = torch.arange(1, horizon + 1, device=dev)[None].expand(b, -1).clone()
    parents = torch.arange(-1, horizon, device=dev)[None].expand(b, -1).clone()
    return DraftTree(
        tokens=tokens,
        depths=depths,
        parents=parents,
        scores=top.cumsum(dim=-1),
        num_nodes=torch.full((b,), horizon, dtype=torch.long, device=dev),
        horizon=horizon,
    )


def _dim_mismatch(c: HiddenContract, shape: tuple) -> str:
    """SGLang's DFlashDraftModel.project_target_hidden error text."""
    return (
        "DFLASH target_hidden feature dim mismatch. "
        f"Expected shape [N, {c.fc_in_features}] (num_context_features={len(c.target_layer_ids)}, "
        f"hidden_size={c.draft_hidden_size}), but got shape={shape}. "
        "This usually means the target model is capturing a different number of layer features than "
        "the draft checkpoint/config expects."
    )


def _load_contract(target_dir, draft_dir) -> HiddenContract:
    """load_contract; a drafter made for another target fails as SGLang's warm-up would, plus our numbers."""
    try:
        return load_contract(target_dir, draft_dir)
    except ContractError as exc:
        if exc.cause != "fc_width_mismatch":
            raise
        c = load_contract(target_dir, draft_dir, check=False)
        shape = ("N", c.capture_width)
        message = f"{_dim_mismatch(c, shape)} [ddtree contract, {exc.cause}: {exc}]"
        raise HiddenStateError(message, exc.cause) from exc

