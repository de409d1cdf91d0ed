"""A toy target and drafter for tree-decode tests on CPU: the MODEL is fake, everything around it
(SGLang's ReqToTokenPool, token-to-KV allocator and MHATokenToKVPool, our tree, walk, commit and
hidden gather) is real.

Toy target: one attention layer, one head, float64. A row's key/value come from its token and
position and are written into SGLang's KV pool; its query attends over the slots its mask allows,
read back from the pool through ``req_to_token``. A tree row therefore sees exactly what its
ancestors wrote: a mask, position or commit bug changes the logits. ``reference_greedy`` runs the
same maths causally on a plain token list (no pool): tree decoding must reproduce it token for token.

Toy drafter: its context is what ``append_draft_context`` wrote into the DRAFT pool (the target's
hidden states); it reads the context tokens back from there, runs the target's own greedy chain
from them and adds noise, so its top-1 is sometimes wrong and a sibling right (the tree's case).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

DTYPE = torch.float64


def make_pools(*, page_size: int, size: int, head_dim: int, rows: int, context: int, draft_dim: int):
    """SGLang's real pools on device cpu: (req_to_token_pool, allocator, target KV, draft KV)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    def kv(dim: int) -> MHATokenToKVPool:
        pool = MHATokenToKVPool(
            size=size,
            page_size=page_size,
            dtype=DTYPE,
            head_num=1,
            head_dim=dim,
            layer_num=1,
            device="cpu",
            enable_memory_saver=False,
        )
        # SGLang's own torch move path (SGLANG_NATIVE_MOVE_KV_CACHE); its default is a GPU kernel.
        pool.use_native_move_kv_cache = True
        return pool

    target_kv, draft_kv = kv(head_dim), kv(draft_dim)
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(
            size=size, dtype=DTYPE, device="cpu", kvcache=target_kv, need_sort=False
        )
    else:
        allocator = PagedTokenToKVPoolAllocator(
            size=size, page_size=page_size, dtype=DTYPE, device="cpu", kvcache=target_kv, need_sort=False
        )
    req_pool = ReqToTokenPool(size=rows, max_context_len=context, device="cpu", enable_memory_saver=False)
    return req_pool, allocator, target_kv, draft_kv


@dataclass
class ToyTarget:
    vocab: int = 12
    dim: int = 16
    max_pos: int = 512
    seed: int = 0
    emb: Tensor = field(init=False)
    pos: Tensor = field(init=False)
    wq: Tensor = field(init=False)
    wv: Tensor = field(init=False)
    out: Tensor = field(init=False)

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(self.seed)
        q, _ = torch.linalg.qr(torch.randn(self.dim, self.dim, generator=g, dtype=DTYPE))
        self.emb = q[: self.vocab] * 3.0  # orthogonal rows: a hidden row names its token exactly
        self.pos = torch.randn(self.max_pos, self.dim, generator=g, dtype=DTYPE) * 0.3
        self.wq = torch.randn(self.dim, self.dim, generator=g, dtype=DTYPE) / self.dim**0.5
        self.wv = torch.randn(self.dim, self.dim, generator=g, dtype=DTYPE) / self.dim**0.5
        self.out = torch.randn(2 * self.dim, self.vocab, generator=g, dtype=DTYPE)

    @property
    def hidden_width(self) -> int:
        return 2 * self.dim  # "two captured layers": [attention output, input embedding]

    def _x(self, tokens: Tensor, positions: Tensor) -> Tensor:
        return self.emb[tokens.long()] + self.pos[positions.long()]

    def kv_rows(self, tokens: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        x = self._x(tokens, positions)
        return x, x @ self.wv

    def head(self, x: Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """One row: x [D], visible keys/values [n, D] -> (logits [V], hidden [2D])."""
        q = x @ self.wq
        att = torch.softmax(keys @ q / self.dim**0.5, dim=0)
        h = torch.cat([att @ values, x])
        return h @ self.out, h

    def token_of(self, hidden: Tensor, positions: Tensor) -> Tensor:
        """Read the token back from hidden rows (the embedding half)."""
        x = hidden[:, self.dim :] - self.pos[positions.long()]
        return (x @ self.emb.T).argmax(dim=-1)

    def forward_pool(
        self, tokens: Tensor, positions: Tensor, write_loc: Tensor, visible: list[Tensor], kv_pool
    ) -> tuple[Tensor, Tensor]:
        """Write every row's K/V at ``write_loc``, then row i attends over slots ``visible[i]``
        read back from the pool."""
        k, v = self.kv_rows(tokens, positions)
        kv_pool.set_kv_buffer(None, write_loc.long(), k.unsqueeze(1), v.unsqueeze(1), layer_id_override=0)
        keys, values = kv_pool.get_key_buffer(0)[:, 0], kv_pool.get_value_buffer(0)[:, 0]
        logits, hidden = zip(
            *(self.head(k[i], keys[s.long()], values[s.long()]) for i, s in enumerate(visible)), strict=True
        )
        return torch.stack(logits), torch.stack(hidden)

    def reference_logits(self, tokens: list[int]) -> Tensor:
        """Causal logits at the last position of a plain token list (no pool)."""
        t = torch.tensor(tokens)
        k, v = self.kv_rows(t, torch.arange(len(tokens)))
        logits, _ = self.head(k[-1], k, v)
        return logits

    def reference_greedy(self, prompt: list[int], n: int) -> list[int]:
        seq = list(prompt)
        for _ in range(n):
            seq.append(int(self.reference_logits(seq).argmax()))
        return seq[len(prompt) :]


class ToyModels:
    """``tree_round.RoundModels`` over the toy target and drafter, on SGLang's pools."""

    def __init__(
        self, target: ToyTarget, req_to_token: Tensor, target_kv, draft_kv, *, noise: float, seed: int = 1
    ):
        self.target = target
        self.req_to_token = req_to_token
        self.target_kv = target_kv
        self.draft_kv = draft_kv
        self.noise = noise
        self.gen = torch.Generator().manual_seed(seed)
        self.draft_contexts: list[list[int]] = []  # what the drafter read back, per request, per round
        self.hidden_override = None  # tests: make the target return this instead of its hidden states
        # As SGLang's Triton verify reads the mask (skip_prefix_custom_mask): the prefix is visible
        # and only the tree cells are read, as the round's graphs write them (round_graphs).
        self.prefix_always_visible = False

    # --- prefill (not part of the round): target KV + drafter context for the prompt ---------
    def prefill(self, req_pool_idx: int, prompt: list[int]) -> int:
        n = len(prompt)
        loc = self.req_to_token[req_pool_idx, :n]
        pos = torch.arange(n)
        logits, hidden = self.target.forward_pool(
            torch.tensor(prompt), pos, loc, [loc[: i + 1] for i in range(n)], self.target_kv
        )
        self.write_draft_context(hidden, loc.long(), pos)
        return int(logits[-1].argmax())

    # --- RoundModels ------------------------------------------------------------------------
    def draft_block(
        self, block_ids: Tensor, positions: Tensor, cache_loc: Tensor, req_pool_indices: Tensor
    ) -> Tensor:
        b, block = block_ids.shape
        # the drafter's own block K/V go to the window slots (overwritten by the commit's append)
        self.draft_kv.set_kv_buffer(
            None,
            cache_loc,
            torch.zeros(b * block, 1, self.target.hidden_width, dtype=DTYPE),
            torch.zeros(b * block, 1, self.target.hidden_width, dtype=DTYPE),
            layer_id_override=0,
        )
        rows = []
        self.draft_contexts.append([])
        for r in range(b):
            prefix = int(positions[r, 0])
            slots = self.req_to_token[int(req_pool_indices[r]), :prefix].long()
            ctx_hidden = self.draft_kv.get_key_buffer(0)[slots, 0]
            context = self.target.token_of(ctx_hidden, torch.arange(prefix)).tolist()
            self.draft_contexts[-1].append(context)
            seq = [*context, int(block_ids[r, 0])]
            out = [torch.zeros(self.target.vocab, dtype=DTYPE)]  # slot 0 (bonus) is not read
            for _ in range(block - 1):
                logits = self.target.reference_logits(seq)
                noisy = logits + self.noise * torch.randn(logits.shape, generator=self.gen, dtype=DTYPE)
                out.append(noisy)
                seq.append(int(logits.argmax()))  # the drafter's chain follows the truth
            rows.append(torch.stack(out))
        return torch.cat(rows).float()

    def draft_hidden(
        self, block_ids: Tensor, positions: Tensor, cache_loc: Tensor, req_pool_indices: Tensor
    ) -> Tensor:
        """The toy drafter's depth rows ``[b, L, V]``: its logits stand in for hidden rows, so the
        round's graphs take the identity head (``toy_head``)."""
        b, block = block_ids.shape
        return self.draft_block(block_ids, positions, cache_loc, req_pool_indices).view(b, block, -1)[:, 1:]

    def target_verify(self, plan, cache_loc: Tensor, req_pool_indices: Tensor):
        b, rows = plan.candidates.shape
        visible, offset = [], 0
        for r in range(b):
            prefix = int(plan.positions.view(b, rows)[r, 0])
            cols = prefix + rows
            mask = plan.custom_mask[offset : offset + rows * cols].view(rows, cols).bool()
            offset += rows * cols
            if self.prefix_always_visible:
                mask = mask.clone()
                mask[:, :prefix] = True
            prefix_slots = self.req_to_token[int(req_pool_indices[r]), :prefix]
            slots = torch.cat([prefix_slots, cache_loc.view(b, rows)[r]])
            visible.extend(slots[mask[i]] for i in range(rows))
        logits, hidden = self.target.forward_pool(
            plan.draft_token, plan.positions, cache_loc, visible, self.target_kv
        )
        if self.hidden_override is not None:
            return logits, self.hidden_override
        return logits, hidden

    def append_draft_context(
        self, hidden: Tensor, cache_loc_2d: Tensor, positions: Tensor, commit_lens: Tensor
    ) -> None:
        """The prefix-valid writer's contract: request r's first ``commit_lens[r]`` rows only."""
        b, width = cache_loc_2d.shape
        keep = (torch.arange(width).expand(b, width) < commit_lens.unsqueeze(1)).reshape(-1)
        self.write_draft_context(hidden[keep], cache_loc_2d.reshape(-1)[keep], positions[keep])

    def write_draft_context(self, hidden: Tensor, cache_loc: Tensor, positions: Tensor) -> None:
        self.draft_kv.set_kv_buffer(
            None, cache_loc.long(), hidden.unsqueeze(1), hidden.unsqueeze(1), layer_id_override=0
        )
