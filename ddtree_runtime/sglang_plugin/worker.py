"""DDTREE's speculative worker, on top of SGLang's DFlash spec-v2 worker.

What it adds to ``DFlashWorkerV2`` (which keeps the drafter, its KV pool, the prompt
materialisation and the CUDA graphs):

* start-up: the hidden-state width check (``ddtree_runtime.core.contract``); a mismatch fails the
  start instead of handing the drafter ``[N, 5120]`` where it expects ``[N, 25600]``;
* after every target forward that captures hidden states for the drafter: the None / shape
  check, and the live handshake (``/server_info``, ``sglang:ddtree_*``);
* the drafter runs its own block (``speculative_dflash_block_size``) while the target verifies
  budget + 1 tree nodes.

Decode:

* the chain case (top-k cap 1, budget = block - 1) is exactly DFlash's argmax chain
  (ddtree-algorithm.md section 7, case 4) and runs ``DFlashWorkerV2``'s own decode;
* every other configuration runs the tree round (``tree_round.run_tree_round``): DFlash's drafter
  block -> ``ddtree_runtime.core.tree`` -> one tree-masked target verify of budget + 1 rows -> hidden
  guard -> walk (greedy, or lossless sampling) -> stop truncation -> KV commit (page size 1:
  re-map the reserved window; page size > 1: move rows) -> the drafter gets the accepted rows'
  hidden states by node index. The model passes are ``sglang_round.SGLangRoundModels``.

Configurations the tree round cannot serve are refused at worker start with the reason
(``check_tree_decode_support``); prefill always runs DFlash's own code (prompt materialisation).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

from ddtree_runtime.core.contract import HiddenContract, load_contract
from ddtree_runtime.core.hidden_states import check_hidden_states
from ddtree_runtime.core.model_files import ContractError
from ddtree_runtime.sglang_plugin.algorithm import is_chain, published_settings, resolved_settings
from ddtree_runtime.sglang_plugin.bounds import verify_mask_cells
from ddtree_runtime.sglang_plugin.gates import GDN, DDTreeConfigError, hybrid_kind, kind_note
from ddtree_runtime.sglang_plugin.handshake import HandshakeMetrics, HandshakeState, static_handshake

logger = logging.getLogger(__name__)


def startup_contract(target_path: str, draft_path: str) -> HiddenContract | None:
    """The width check at worker start: raises ContractError when the drafter's ``fc`` does not
    take what the target captures. None when the models are not local directories (the check
    then runs on the loaded drafter, see ``check_loaded_widths``)."""
    if not (os.path.isdir(target_path) and os.path.isdir(draft_path)):
        return None
    return load_contract(target_path, draft_path)


def check_loaded_widths(target_hidden: int, layer_ids: list[int], fc_in_features: int) -> None:
    """Same check on the loaded models, for hub paths that ``startup_contract`` cannot read."""
    width = len(layer_ids) * target_hidden
    if width != fc_in_features:
        raise ContractError(
            "fc_width_mismatch",
            f"drafter fc expects [N, {fc_in_features}] but the target captures [N, {width}] "
            f"({len(layer_ids)} target layers x {target_hidden})",
            expected=fc_in_features,
            capture_width=width,
        )


def _captures_full(mode: Any) -> bool:
    # CaptureHiddenMode.FULL (= 2) is what feeds the drafter; NULL/LAST forwards do not.
    return mode is not None and (getattr(mode, "name", None) == "FULL" or mode == 2)


def _rows_of(batch: Any, forward_batch: Any) -> int | None:
    if forward_batch is not None and getattr(forward_batch, "input_ids", None) is not None:
        return int(forward_batch.input_ids.shape[0])
    extend_lens = getattr(batch, "extend_lens", None)
    if extend_lens is not None:
        return int(sum(extend_lens))
    return None


def guard_target_forward(
    forward: Callable[..., Any],
    contract: HiddenContract,
    handshake: HandshakeState,
    on_update: Callable[[dict[str, Any]], None] | None = None,
) -> Callable[..., Any]:
    """Wrap ``TpModelWorker.forward_batch_generation``: after every forward whose hidden states
    go to the drafter, record the observed width and check None / rank / width / row count."""

    def guarded(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        forward_batch = kwargs.get("forward_batch")
        batch = kwargs.get("batch", args[0] if args else None)
        mode = kwargs.get("capture_hidden_mode", getattr(forward_batch, "capture_hidden_mode", None))
        rows = _rows_of(batch, forward_batch)
        if not _captures_full(mode) or not rows:
            return out  # idle rank or a forward that feeds no drafter
        logits_output = getattr(out, "logits_output", None)
        hidden = getattr(logits_output, "hidden_states", None)
        handshake.observe(hidden)
        if on_update is not None:
            on_update(handshake.to_dict())
        check_hidden_states(hidden, contract, num_tokens=rows)
        return out

    guarded.__wrapped__ = forward  # type: ignore[attr-defined]
    return guarded


class TreeDecodeNotAvailable(DDTreeConfigError):
    """A configuration the tree decode round cannot serve (the message says why and what starts)."""


def check_tree_decode_support(settings: dict[str, Any], cfg: Any) -> None:
    """Start-up refusals of the tree round, from the launch flags (chain configurations run
    DFlash's decode and pass)."""
    if is_chain(settings):
        return
    hits = []
    if getattr(cfg, "enable_dp_attention", False):
        hits.append(
            "--enable-dp-attention: idle DP ranks must mirror the verify's collectives with the "
            "tree width, which the tree round does not do"
        )
    if getattr(cfg, "speculative_draft_window_size", None):
        hits.append(
            "--speculative-draft-window-size: the compact draft cache re-maps the drafter's KV by "
            "contiguous prefix; the tree round appends accepted rows at explicit slots"
        )
    if hits:
        raise TreeDecodeNotAvailable(_tree_refusal(settings, hits))


def check_tree_worker_features(settings: dict[str, Any], worker: Any) -> None:
    """The same, for what only the built DFlash worker knows (drafter heads, hybrid state)."""
    if is_chain(settings):
        return
    hits = []
    if getattr(worker, "_need_mamba_verify_commit", False):
        hits.extend(_hybrid_tree_problems(settings, worker.target_worker.model_runner))
    for attr, what in (("selector", "a selector draft head"), ("lilicorr", "a LiLiCorr draft head")):
        if getattr(worker, attr, None) is not None:
            hits.append(f"{what}: the tree needs the drafter's full logits per depth")
    if getattr(worker, "_is_domino", False):
        hits.append("a Domino drafter: its rollout replaces the per-depth logits the tree ranks")
    if hits:
        raise TreeDecodeNotAvailable(_tree_refusal(settings, hits))


def _hybrid_tree_problems(settings: dict[str, Any], runner: Any) -> list[str]:
    """A recurrent-state target: only GDN layers, with dense per-row scratch wide enough."""
    from ddtree_runtime.sglang_plugin.hybrid import HybridScratchError, check_tree_scratch

    kind = hybrid_kind(runner.model_config)
    if kind != GDN:
        return [f"a hybrid target with {kind_note(str(kind))}"]
    try:
        check_tree_scratch(runner.req_to_token_pool, int(settings["budget"]) + 1)
    except HybridScratchError as exc:
        return [f"a GDN hybrid target whose state pool cannot hold a tree: {exc}"]
    return []


def _tree_refusal(settings: dict[str, Any], hits: list[str]) -> str:
    block = settings["block_size"]
    return (
        f"DDTREE cannot run a tree (budget {settings['budget']}, top-k cap {settings['topk_cap']}) "
        "with:\n  - " + "\n  - ".join(hits) + "\nWhat starts: drop the flag named above, or run "
        f"the chain case --speculative-ddtree-topk-cap 1 --speculative-ddtree-budget {block - 1} "
        "(decoded exactly like DFLASH), or --speculative-algorithm DFLASH."
    )


class TreeGraphsNotCaptured(DDTreeConfigError):
    """The target's CUDA graphs would replay a chain's verify for trees (the message says why)."""


def check_tree_graphs(runner: Any) -> None:
    """Worker start, tree configurations: a hybrid target's linear-attention backend must be in
    tree mode before anything is captured (``graph_sites.linear_backend_tree_hook``); otherwise its
    graphs hold the chain kernels and every tree verify would commit wrong recurrent state."""
    from ddtree_runtime.sglang_plugin.graph_sites import LINEAR_BACKEND_INIT, linear_backend_in_tree_mode

    if linear_backend_in_tree_mode(runner.attn_backend) is False:
        raise TreeGraphsNotCaptured(
            "DDTREE trees on a hybrid target need its linear-attention backend in tree mode from "
            f"construction, but it answers top-k {runner.attn_backend.linear_attn_backend.topk}: the "
            f"plugin's hook on {LINEAR_BACKEND_INIT} did not run (is SGLANG_PLUGINS set for the "
            "scheduler processes?). Its graphs would verify every tree as a chain."
        )


class DDTreeWorker(DFlashWorkerV2):
    """DFlash drafter + DDTREE tree verify (see module docstring)."""

    def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, target_worker: Any) -> None:
        settings = resolved_settings(server_args) or published_settings()
        if settings is None:
            raise DDTreeConfigError(
                "DDTreeWorker started without DDTREE's resolved settings: was the server started "
                "with --speculative-algorithm DDTREE and the ddtree plugin loaded (SGLANG_PLUGINS)?"
            )
        self.ddtree_settings = settings
        from sglang.srt.arg_groups.overrides import resolving_view

        cfg = resolving_view(server_args)
        contract = startup_contract(str(cfg.model_path), str(cfg.speculative_draft_model_path))
        check_tree_decode_support(settings, cfg)
        self._ddtree_contract = contract
        base = static_handshake({**settings, "contract": contract.to_dict() if contract else None})
        self._ddtree_handshake = HandshakeState(base)
        self._ddtree_metrics = HandshakeMetrics() if cfg.enable_metrics else None
        if contract is not None:
            target_worker.forward_batch_generation = guard_target_forward(
                target_worker.forward_batch_generation, contract, self._ddtree_handshake, self._publish
            )
        self._publish(self._ddtree_handshake.to_dict())
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        if not is_chain(settings):
            self._adopt_drafter_block()

    def init_cuda_graphs(self) -> None:
        """The scheduler calls this once the pools and attention backends exist (SGLang 0.5.23 builds
        workers first, then pools, backends and graphs, the target's before the drafter's): the
        tree checks that read them run here, before the drafter's graphs are captured."""
        check_tree_worker_features(self.ddtree_settings, self)
        if not is_chain(self.ddtree_settings):
            check_tree_graphs(self.target_worker.model_runner)
        super().init_cuda_graphs()

    def _adopt_drafter_block(self) -> None:
        """DFlashWorkerV2 sizes its drafter block from speculative_num_draft_tokens, which for a
        tree is the shared KV window max(budget + 1, block). The drafter keeps its own block; the
        window stays speculative_num_draft_tokens (what the scheduler reserves)."""
        from sglang.srt.speculative.draft_worker_common import (
            build_block_pos_offsets,
            make_draft_block_spec_info,
        )

        self.block_size = int(self.ddtree_settings["block_size"])
        self.draft_model.set_block_size(self.block_size)
        self._block_pos_offsets = build_block_pos_offsets(length=self.block_size, device=self.device)
        self._draft_block_spec_info = make_draft_block_spec_info(
            draft_token_num=self.block_size, device=self.device
        )

    def _maybe_build_draft_sampler(self) -> Any:
        """Called by DFlashWorkerV2 right before it captures the drafter's graphs
        (``dflash_worker_v2.py`` ~743). The chain case keeps DFLASH's greedy head folded into the
        draft graph. A tree ranks the drafter's full per-depth logits, so the argmax head (an
        ``lm_head`` matmul over the vocabulary per block row) would be captured and replayed for
        nothing: none is built, and the drafter's own block is adopted first so the draft graph is
        captured for the block the tree round runs."""
        if is_chain(self.ddtree_settings):
            return super()._maybe_build_draft_sampler()
        self._adopt_drafter_block()
        logger.info("DDTREE: no draft greedy head in the draft graph (the tree ranks every depth's top-K).")
        return None

    def _publish(self, handshake: dict[str, Any]) -> None:
        if self._ddtree_metrics is not None:
            self._ddtree_metrics.update(handshake)

    def ddtree_handshake(self) -> dict[str, Any]:
        return self._ddtree_handshake.to_dict()

    # --- decode ------------------------------------------------------------------------------
    def forward_batch_generation(
        self, batch: Any, on_publish: Any = None, grammar_barrier: Any = None, pp_proxy_tensors: Any = None
    ) -> Any:
        mode = batch.forward_mode
        if is_chain(self.ddtree_settings) or mode.is_extend() or batch.is_extend_in_batch or mode.is_idle():
            # Chain decode, prefill (prompt materialised into draft KV) and idle ranks: DFlash's code.
            return super().forward_batch_generation(
                batch,
                on_publish=on_publish,
                grammar_barrier=grammar_barrier,
                pp_proxy_tensors=pp_proxy_tensors,
            )
        return self._tree_decode(batch, on_publish)

    def _tree_decode(self, batch: Any, on_publish: Any) -> Any:
        from sglang.srt.managers.utils import GenerationBatchResult

        from ddtree_runtime.sglang_plugin.tree_round import RoundConfig, run_tree_round

        if batch.has_grammar:
            # Not refusable at start (per request). NB: SGLang's scheduler does not survive this.
            raise RuntimeError(
                "DDTREE tree decode does not support grammar-constrained requests yet; serve them "
                "with the chain case or --speculative-algorithm DFLASH."
            )
        draft_input = batch.spec_info
        settings = self.ddtree_settings
        runner = self.target_worker.model_runner
        cfg = RoundConfig(
            budget=int(settings["budget"]),
            block_size=int(self.block_size),
            mask_token_id=int(self._mask_token_id),
            page_size=int(runner.token_to_kv_pool_allocator.page_size),
            topk_cap=settings["topk_cap"],
            window=int(self.speculative_num_draft_tokens),  # the reservation the round writes
        )
        if batch.seq_lens.is_cuda:
            # Carried over from the previous overlap iteration, possibly made on another stream
            # (as DFlashWorkerV2's decode does).
            batch.seq_lens.record_stream(torch.cuda.current_stream(batch.seq_lens.device))
        models = self._round_models(batch)
        commit_state = None
        if getattr(self, "_need_mamba_verify_commit", False):
            # GDN hybrid: the accepted node's recurrent state, committed after the walk and the
            # stop truncation, before any other target forward (hybrid.commit_tree_state).
            from ddtree_runtime.sglang_plugin.hybrid import commit_tree_state

            def commit_state(accept_index: torch.Tensor, commit_lens: torch.Tensor) -> None:
                commit_tree_state(self.target_worker, batch, accept_index, commit_lens, cfg.verify_rows)

        result = run_tree_round(
            models,
            round_input(batch, draft_input.bonus_tokens, mask_cells=verify_mask_cells(batch, cfg, runner)),
            cfg,
            req_to_token=runner.req_to_token_pool.req_to_token,
            kv_pool=runner.token_to_kv_pool,
            contract=self._ddtree_contract,
            on_hidden=self._observe_hidden,
            commit_state=commit_state,
            # Published as soon as the lengths are final, before the drafter's context append
            # (DFlashWorkerV2 does the same): the overlap scheduler's next resolve may go on.
            on_lengths=on_publish,
        )
        next_draft_input = self._make_next_draft_input_decode(
            bonus_tokens=result.bonus_tokens, new_seq_lens=result.new_seq_lens
        )
        target_out = getattr(models, "last_target_out", None)
        if batch.return_logprob:
            add_tree_logprobs(batch, target_out.logits_output, result.out_tokens, result.accept.accept_index)
        return GenerationBatchResult(
            logits_output=getattr(target_out, "logits_output", None),
            next_token_ids=result.out_tokens.reshape(-1),
            accept_lens=result.commit_lens.to(torch.int32),
            # The target verify's own answer: replayed from a graph captured for trees, or eager.
            can_run_cuda_graph=bool(getattr(target_out, "can_run_cuda_graph", False)),
            next_draft_input=next_draft_input,
            speculative_num_draft_tokens=cfg.verify_rows,  # accept-rate denominator: tree nodes
            speculative_output_stride=int(result.out_tokens.shape[1]),
            new_seq_lens=result.new_seq_lens,
            routed_experts_output=getattr(target_out, "routed_experts_output", None),
            indexer_topk_output=getattr(target_out, "indexer_topk_output", None),
        )

    def _round_models(self, batch: Any) -> Any:
        """The round's model passes (``tree_round.RoundModels``): SGLang's runners."""
        from ddtree_runtime.sglang_plugin.sglang_round import SGLangRoundModels

        return SGLangRoundModels(self, batch)

    def _observe_hidden(self, hidden: Any) -> None:
        self._ddtree_handshake.observe(hidden)
        self._publish(self._ddtree_handshake.to_dict())


def add_tree_logprobs(batch: Any, logits_output: Any, out_tokens: Any, accept_index: Any) -> None:
    """SGLang's own speculative logprobs (``logprob_processor.compute_spec_logprobs``, its EAGLE-tree
    mode) for the tokens a tree round emitted: emitted token k of a request was decided at verify row
    ``accept_index[r, k]`` (-1 padded), so each is scored by that row's target logits, as the plain
    server scores a decoded token. Without it a ``return_logprob`` request past its prefill raised
    here, and the exception ended SGLang's scheduler."""
    from sglang.srt.layers.logprob_processor import compute_spec_logprobs

    rows = logits_output.next_token_logits.shape[0]
    # A scatter with padding sent to a spare last row, not a boolean selection (a host read).
    at = torch.where(accept_index >= 0, accept_index, rows).reshape(-1).long()
    predict = torch.zeros(rows + 1, dtype=torch.long, device=out_tokens.device)
    predict.scatter_(0, at, out_tokens.reshape(-1).long())
    compute_spec_logprobs(batch, logits_output, predict[:rows], accept_index=accept_index)


def round_input(batch: Any, bonus_tokens: Any, mask_cells: int | None = None) -> Any:
    """``RoundInput`` from a ScheduleBatch: prefix, bonus, per-request sampling and stop tokens.
    Greedy is SGLang's host flag ``is_all_greedy`` (temperatures None), never read from tensors."""
    from ddtree_runtime.sglang_plugin.tree_round import RoundInput

    info = batch.sampling_info
    temperatures = top_ks = top_ps = None
    if info is not None and not info.is_all_greedy:
        top_ks = info.top_ks.reshape(-1)
        # SGLang marks greedy requests with top_k <= 1 (temperature 0 becomes top_k 1).
        temperatures = torch.where(top_ks <= 1, 0.0, info.temperatures.reshape(-1).float())
        top_ps = info.top_ps.reshape(-1)
    return RoundInput(
        req_pool_indices=batch.req_pool_indices,
        prefix_lens=batch.seq_lens,
        bonus_tokens=bonus_tokens,
        temperatures=temperatures,
        top_ks=top_ks,
        top_ps=top_ps,
        stop_token_ids=tuple(stop_ids(req) for req in batch.reqs),
        mask_cells=mask_cells,
    )


def stop_ids(req: Any) -> frozenset[int]:
    """Token ids that end this request (its stop_token_ids, plus EOS unless ignore_eos)."""
    params = req.sampling_params
    ids = set(getattr(params, "stop_token_ids", None) or ())
    if not getattr(params, "ignore_eos", False):
        ids |= set(getattr(req, "eos_token_ids", None) or ())
    return frozenset(int(i) for i in ids)
