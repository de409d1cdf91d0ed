"""The tree round's CUDA graphs (``round_graphs``) on a real GPU: a captured bucket's replays give
what the same stages give run eagerly on the same inputs, bit for bit (tree, verify arrays, mask
cells, walk, stop cut, accepted rows, KV moves, packed outputs), for batches smaller than their
bucket too, with no host sync; a bucket's capture compiles every kernel it launches."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from ddtree_runtime.sglang_plugin.round.round_graphs import GraphSpec, RoundGraphs  # noqa: E402
from ddtree_runtime.sglang_plugin.round.tree_round import RoundConfig, RoundInput  # noqa: E402

DEV = torch.device("cuda")
VOCAB, HIDDEN, CONTEXT, SLOTS = 4096, 256, 512, 8192


class TorchKV:
    """A one-layer KV pool with SGLang's ``move_kv_cache(dst, src)`` (gather, then scatter)."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator(device=DEV).manual_seed(seed)
        self.k = torch.randn((SLOTS, 8), device=DEV, generator=gen)

    def move_kv_cache(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.k[dst] = self.k[src]


def _graphs(cfg: RoundConfig, *, capture: bool, sizes: list[int]):
    gen = torch.Generator(device=DEV).manual_seed(0)
    weight = (torch.randn((VOCAB, HIDDEN), device=DEV, generator=gen) / HIDDEN**0.5).to(torch.bfloat16)
    spec = GraphSpec(
        cfg=cfg,
        head=lambda rows: torch.matmul(rows.to(weight.dtype), weight.t()).float(),
        hidden_size=HIDDEN,
        hidden_dtype=torch.bfloat16,
        kv_pool=TorchKV(1),
        mask_buffer=torch.zeros(
            max(sizes) * cfg.verify_rows * (CONTEXT + cfg.verify_rows), dtype=torch.bool, device=DEV
        ),
        mask_max_bs=max(sizes),
    )
    graphs = RoundGraphs(spec, DEV, capture=capture)
    assert graphs.build(sizes) == sorted(sizes)
    return graphs


def _round_inputs(b: int, cfg: RoundConfig, gen: torch.Generator):
    horizon = cfg.block_size - 1
    hidden = torch.randn((b, horizon, HIDDEN), device=DEV, generator=gen).to(torch.bfloat16)
    root = torch.randint(0, VOCAB, (b,), device=DEV, generator=gen)
    prefix = torch.randint(0, CONTEXT - 2 * cfg.write_window, (b,), device=DEV, generator=gen)
    slots = torch.randperm(SLOTS - 1, device=DEV, generator=gen)[: b * cfg.write_window].view(b, -1) + 1
    return hidden, root, prefix, slots


def _posterior_following(plan, b: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    """The target's choice per row: random, except along one root path per request, which it
    follows for a random depth (so the walk accepts several nodes, not only the root)."""
    post = torch.randint(0, VOCAB, (b, rows), device=DEV, generator=gen)
    parents, tokens = plan.tree.parents.cpu(), plan.tree.tokens.cpu()
    for r in range(b):
        node = int(torch.randint(1, rows, (1,), generator=torch.Generator().manual_seed(r)))
        while node > 0:
            parent = int(parents[r, node])
            post[r, parent] = int(tokens[r, node - 1])
            node = parent
    return post.reshape(-1)


@pytest.mark.parametrize(("budget", "depth_first"), [(15, False), (16, False), (32, False), (15, True)])
def test_replayed_buckets_match_the_same_stages_run_eagerly(budget, depth_first):
    cfg = RoundConfig(budget=budget, block_size=16, mask_token_id=0, page_size=1, depth_first=depth_first)
    sizes = [1, 2, 4, 8]
    graphed = _graphs(cfg, capture=True, sizes=sizes)
    compiled = _compiled_kernels()
    eager = _graphs(cfg, capture=False, sizes=sizes)
    graphed.spec.mask_buffer.zero_()  # the capture's warm-up wrote cells; the rounds below compare
    gen = torch.Generator(device=DEV).manual_seed(budget)
    stops = None
    for round_no, b in enumerate([3, 1, 8, 5, 2, 4, 4]):
        hidden, root, prefix, slots = _round_inputs(b, cfg, gen)
        if round_no >= 4:  # from here on, requests stop on their root token (often emitted)
            stops = tuple(frozenset({int(root[r]), 7}) for r in range(b))
        inp = RoundInput(req_pool_indices=torch.arange(b, device=DEV), prefix_lens=prefix, bonus_tokens=root)
        cells = cfg.verify_rows * int(prefix.sum() + cfg.verify_rows * b)
        got_bucket, want_bucket = graphed.plan_stage(b, inp), eager.plan_stage(b, inp)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got_plan = got_bucket.plan(hidden, root, prefix, cells)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want_plan = want_bucket.plan(hidden, root, prefix, cells)
        for field in (
            "draft_token",
            "positions",
            "retrieve_next_token",
            "retrieve_next_sibling",
            "candidates",
        ):
            assert torch.equal(getattr(got_plan, field), getattr(want_plan, field)), field
        assert torch.equal(got_plan.tree.parents, want_plan.tree.parents)
        assert torch.equal(graphed.spec.mask_buffer, eager.spec.mask_buffer)
        posterior = _posterior_following(want_plan, b, cfg.verify_rows, gen)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = got_bucket.accept(posterior, slots, stops)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want = want_bucket.accept(posterior, slots, stops)
        assert got is not None and want is not None
        for name, a, w in [
            ("emitted", got.walk.emitted, want.walk.emitted),
            ("num_emitted", got.walk.num_emitted, want.walk.num_emitted),
            ("accept_index", got.accept.accept_index, want.accept.accept_index),
            ("new_seq_lens", got.kv.new_seq_lens, want.kv.new_seq_lens),
            ("finished", got.finished, want.finished),
            ("context_rows", got.context_rows, want.context_rows),
            ("context_positions", got.context_positions, want.context_positions),
        ]:
            assert torch.equal(a, w), f"round {round_no} (batch {b}): {name}"
        assert int(got.walk.num_emitted.max()) > 1, "the posterior should accept draft nodes"
        assert torch.equal(graphed.spec.kv_pool.k, eager.spec.kv_pool.k), f"round {round_no}: KV moves differ"
    # the eager stages launched the graphs' kernels at the buckets' shapes: nothing new compiled
    assert _compiled_kernels() == compiled


def _compiled_kernels() -> int:
    """Compiled Triton kernels in this process (every JITFunction's per-device cache)."""
    import gc

    from triton.runtime.jit import JITFunction

    total = 0
    for obj in gc.get_objects():
        if isinstance(obj, JITFunction):
            for cache in getattr(obj, "device_caches", {}).values():
                total += len(cache[0])
    return total
