"""DDTREE's speculative worker, on top of SGLang's DFlash spec-v2 worker.

What it adds to ``DFlashWorkerV2`` (which keeps the drafter, its KV pool, the prompt
materialisation and the CUDA graphs):

* start-up: the hidden-state width check, from the files before loading (``core.contract``), and
  for hub ids (no files to read) from the loaded models (``refusals.worker_start.loaded_contract``,
  for local directories a second check); a mismatch fails
  the start instead of handing the drafter ``[N, 5120]`` where it expects ``[N, 25600]``;
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
  hidden states by node index. The model passes are ``sglang_models.SGLangRoundModels``.

Configurations the tree round cannot serve are refused at worker start with the reason
(``check_tree_decode_support``); prefill always runs DFlash's own code (prompt materialisation).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any

import torch
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

from ddtree_runtime.core.contract import HiddenContract
from ddtree_runtime.sglang_plugin.algorithm import is_chain, published_settings, resolved_settings
from ddtree_runtime.sglang_plugin.ddtree_info import round_input
from ddtree_runtime.sglang_plugin.handshake import HandshakeMetrics, HandshakeState, static_handshake
from ddtree_runtime.sglang_plugin.hidden_guard import guard_target_forward
from ddtree_runtime.sglang_plugin.refusals.resolution import DDTreeConfigError
from ddtree_runtime.sglang_plugin.refusals.worker_start import (
    check_tree_decode_support,
    check_tree_graphs,
    check_tree_worker_features,
    loaded_contract,
    startup_contract,
)
from ddtree_runtime.sglang_plugin.round.bounds import verify_mask_cells

logger = logging.getLogger(__name__)

# Request-rounds each width of an adaptive server runs before its own mean is trusted
# (core/width_policy.DEFAULT_EXPLORE_ROWS unless set).
EXPLORE_ROWS_ENV = "SGLANG_DDTREE_WIDTH_EXPLORE_ROWS"


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
        # From the files (local directories): a mismatch fails before any weight is loaded.
        contract = startup_contract(str(cfg.model_path), str(cfg.speculative_draft_model_path))
        check_tree_decode_support(settings, cfg)
        self._ddtree_metrics = HandshakeMetrics() if cfg.enable_metrics else None
        # Counterfactual scoring (counterfactual_hook), built once the pools and graphs exist; the counters'
        # model_name label as the lab engine's, None when --enable-metrics is off (scored, not published).
        self._ddtree_scoring: Any = None
        self._ddtree_prices: Any = None  # the start-up price table (init_cuda_graphs, with the switch on)
        self._ddtree_scoring_model = (
            str(cfg.served_model_name or cfg.model_path) if cfg.enable_metrics else None
        )
        self._guard_widths(target_worker, contract)
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        # The contract as SGLang loaded the two models: the one check for hub ids (no files to
        # read above), a second one for local directories.
        loaded = loaded_contract(target_worker.model_runner, self.draft_model, settings)
        if contract is None:
            self._guard_widths(target_worker, loaded)
        if not is_chain(settings):
            self._adopt_drafter_block()

    def _guard_widths(self, target_worker: Any, contract: HiddenContract | None) -> None:
        """The handshake from ``contract`` (None: unknown), published, and with a contract the
        hidden-state check after every target forward."""
        self._ddtree_contract = contract
        base = static_handshake(self.ddtree_settings.with_contract(contract.to_dict() if contract else None))
        self._ddtree_handshake = HandshakeState(base)
        if contract is not None:
            target_worker.forward_batch_generation = guard_target_forward(
                target_worker.forward_batch_generation, contract, self._ddtree_handshake, self._publish
            )
        self._publish(self._ddtree_handshake.to_dict())

    def init_cuda_graphs(self) -> None:
        """The scheduler calls this once the pools and attention backends exist (SGLang 0.5.23 builds
        workers first, then pools, backends and graphs, the target's before the drafter's): the
        tree checks that read them run here, before the drafter's graphs are captured."""
        check_tree_worker_features(self.ddtree_settings, self)
        if not is_chain(self.ddtree_settings):
            check_tree_graphs(self.target_worker.model_runner)
        super().init_cuda_graphs()
        self._round_graphs = None
        self._round_graphs_by_width: dict[int, Any] = {}
        self._ddtree_width_runners: dict[int, Any] = {}
        if not is_chain(self.ddtree_settings):
            # After SGLang's captures, before the server says ready: the round's own graphs, and
            # with them every Triton kernel the round launches, compiled now (round_graphs).
            from ddtree_runtime.sglang_plugin.round.round_graphs import round_graphs_for_worker

            cfg = self._round_config()
            if cfg.depth_first:
                logger.info("DDTREE: verify rows depth first (GDN parents' states kept in registers).")
            self._ddtree_width_runners = self._build_width_runners()
            self._round_graphs = round_graphs_for_worker(self, cfg)
            self._round_graphs_by_width[cfg.budget] = self._round_graphs
            for budget in self._ddtree_width_runners:  # a narrower width's graphs on its own backend
                with self._width_bound(budget):
                    graphs = round_graphs_for_worker(self, self._round_config(budget))
                self._round_graphs_by_width[budget] = graphs
        # Counterfactual scoring, built (and its candidates' tree builds compiled) before the server says
        # ready, not at the first decode round under traffic (counterfactual_hook.build_scoring).
        self._counterfactual()
        # Last, once every graph exists: the round's prices, timed now and never in a served round.
        self._ddtree_prices = self._measure_prices() if self.ddtree_settings.price_table else None
        self._ddtree_width_choice = self._width_choice()

    def _measure_prices(self) -> Any:
        """The start-up price table (``price_table``), published on /metrics; None (logged) for the chain
        or when it cannot be measured: serving goes on without it."""
        if is_chain(self.ddtree_settings):
            logger.warning("DDTREE: no price table for the chain (it runs DFlash's own round).")
            return None
        from ddtree_runtime.core.round_prices import width_label
        from ddtree_runtime.sglang_plugin.price_stages import worker_stages
        from ddtree_runtime.sglang_plugin.price_table import measure_prices, merge_tables

        decoder = self.ddtree_settings.decoder
        tables = []
        try:
            sizes = None  # every width at the widest one's batch sizes (an adaptive server compares them)
            runners = self.__dict__.get("_ddtree_width_runners") or {}
            for budget in reversed(decoder.budgets):
                graphs = self._graphs_for(budget)
                # A narrower width with its own runtime is priced bound to it; without, eagerly at its rows.
                own = budget == decoder.budget or budget in runners
                with self._width_bound(budget):
                    rows = None if own else budget + 1
                    sizes, stages, method, sync = worker_stages(
                        self, self._round_config(budget), graphs, sizes=sizes, rows=rows
                    )
                    label = width_label(budget, chain=False)
                    tables.append(measure_prices(label, sizes, stages, method=method, sync=sync))
        except Exception as exc:  # a price table must not stop a server that serves
            logger.warning("DDTREE: no price table (%s: %s)", type(exc).__name__, exc, exc_info=True)
            return None
        table = merge_tables(tables)
        if self._ddtree_metrics is not None and _publishing_rank():
            from ddtree_runtime.sglang_plugin.price_metrics import PriceMetrics

            PriceMetrics().publish(table)
        return table

    def _graphs_for(self, budget: int) -> Any:
        """The round graphs of a width: the widest's; a narrower width's where it has verify graphs of its
        own (``round/width_runners``), else None: its rounds and its verify run eagerly."""
        by_width = self.__dict__.get("_round_graphs_by_width")
        if by_width is None:  # built by hand (tests): the widest width's graphs only
            widest = budget == self.ddtree_settings.decoder.budget
            return getattr(self, "_round_graphs", None) if widest else None
        return by_width.get(budget)

    def _build_width_runners(self) -> dict[int, Any]:
        """An adaptive server's narrower widths' own attention backends and verify graphs, with
        ``SGLANG_DDTREE_WIDTH_GRAPHS=1`` (``round/width_runners``); {} otherwise, or (logged) when they
        cannot be built: those widths then run eagerly."""
        from ddtree_runtime.sglang_plugin.round import width_runners

        decoder = self.ddtree_settings.decoder
        if not decoder.adaptive or not width_runners.wanted():
            return {}
        try:
            return width_runners.build_width_runners(self.target_worker.model_runner, decoder.budgets)
        except Exception as exc:  # the widest width still serves; the narrower ones run eagerly
            logger.warning("DDTREE: no runtime of their own for widths %s (%s: %s): they run eagerly",
                           list(decoder.budgets[:-1]), type(exc).__name__, exc, exc_info=True)  # fmt: skip
            return {}

    def _width_bound(self, budget: int | None) -> Any:
        """The target's model runner bound to ``budget``'s own backend and graphs while inside (a narrower
        width that has them); nothing changes otherwise."""
        from contextlib import nullcontext

        from ddtree_runtime.sglang_plugin.round.width_runners import bound

        runners = self.__dict__.get("_ddtree_width_runners") or {}
        width = runners.get(budget) if budget is not None else None
        return nullcontext() if width is None else bound(self.target_worker.model_runner, width)

    def _width_choice(self) -> Any:
        """An adaptive server's per-round width (``round/width_choice``), over its price table; None for a
        fixed budget, or (logged) without prices: then every round verifies the widest width."""
        decoder = self.ddtree_settings.decoder
        if not decoder.adaptive:
            return None
        prices = self.__dict__.get("_ddtree_prices")
        if prices is None:
            logger.warning("DDTREE: adaptive widths %s have no price table: every round verifies budget %d.",
                           list(decoder.budgets), decoder.budget)  # fmt: skip
            return None
        from ddtree_runtime.sglang_plugin.round.width_choice import WidthChoice
        from ddtree_runtime.sglang_plugin.warmup import RID_PREFIX

        publish = None
        if self._ddtree_metrics is not None and _publishing_rank():
            from ddtree_runtime.sglang_plugin.width_metrics import WidthMetrics

            publish = WidthMetrics().publish
        runner = self.target_worker.model_runner
        device = torch.device(runner.device if isinstance(runner.device, str) else str(runner.device))
        explore = os.environ.get(EXPLORE_ROWS_ENV)  # a test's short exploration; the default otherwise
        extra = {"explore_rows": int(explore)} if explore else {}
        choice = WidthChoice(
            decoder.budgets, prices, device, warmup_prefix=RID_PREFIX, publish=publish, **extra
        )
        logger.info("DDTREE: adaptive widths %s, chosen per round from prices at batch sizes %s",
                    list(decoder.budgets), sorted({b for _, b in choice.chooser.prices}))  # fmt: skip
        return choice

    def ddtree_widths(self) -> dict[str, Any] | None:
        """An adaptive server's width choice as ``/server_info`` shows it
        (``internal_states[i].ddtree_widths``)."""
        choice = self.__dict__.get("_ddtree_width_choice")
        return choice.to_dict() if choice is not None else None

    def ddtree_prices(self) -> dict[str, Any] | None:
        """The start-up price table as ``/server_info`` shows it (``internal_states[i].ddtree_prices``)."""
        table = self.__dict__.get("_ddtree_prices")  # not DFlashWorkerV2's attribute lookup
        return table.to_dict() if table is not None else None

    def _adopt_drafter_block(self) -> None:
        """DFlashWorkerV2 sizes its drafter block from speculative_num_draft_tokens, which for a
        tree is the shared KV window max(budget + 1, block). The drafter keeps its own block; the
        window stays speculative_num_draft_tokens (what the scheduler reserves)."""
        from sglang.srt.speculative.draft_worker_common import (
            build_block_pos_offsets,
            make_draft_block_spec_info,
        )

        self.block_size = self.ddtree_settings.decoder.block_size
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
        decode = not (mode.is_extend() or batch.is_extend_in_batch or mode.is_idle())
        scoring = self._counterfactual() if decode else None
        if scoring is not None:
            scoring.begin(batch)  # host only: this round's sampling decision
        if is_chain(self.ddtree_settings) or not decode:
            # Chain decode, prefill (prompt materialised into draft KV) and idle ranks: DFlash's code.
            result = super().forward_batch_generation(
                batch,
                on_publish=on_publish,
                grammar_barrier=grammar_barrier,
                pp_proxy_tensors=pp_proxy_tensors,
            )
        else:
            result = self._tree_decode(batch, on_publish)
        if scoring is not None:
            scoring.end(result)  # device ops only (counterfactual_hook)
        return result

    # --- counterfactual acceptance (counterfactual_hook) -----------------------------------------
    def _counterfactual(self) -> Any:
        """The worker's ``WorkerScoring``, or None: fraction 0 builds nothing and runs nothing."""
        scoring = getattr(self, "_ddtree_scoring", None)
        if scoring is None:
            cf = self.ddtree_settings.counterfactual
            if cf is None or not cf.enabled:
                scoring = False
            else:
                from ddtree_runtime.sglang_plugin.counterfactual_hook import build_scoring

                scoring = (
                    build_scoring(self, model_name=getattr(self, "_ddtree_scoring_model", None)) or False
                )
            self._ddtree_scoring = scoring  # False: decided, off
        return scoring or None

    def ddtree_counterfactual_flush(self) -> None:
        """The scheduler is idle: publish the counters (``counterfactual_hook.flush_on_idle``)."""
        if getattr(self, "_ddtree_scoring", None):
            self._ddtree_scoring.flush()

    def _tree_decode(self, batch: Any, on_publish: Any) -> Any:
        from sglang.srt.managers.utils import GenerationBatchResult

        from ddtree_runtime.sglang_plugin.round.tree_round import run_tree_round

        if batch.has_grammar:
            # Not refusable at start (per request). NB: SGLang's scheduler does not survive this.
            raise RuntimeError(
                "DDTREE tree decode does not support grammar-constrained requests yet; serve them "
                "with the chain case or --speculative-algorithm DFLASH."
            )
        draft_input = batch.spec_info
        runner = self.target_worker.model_runner
        choice = self.__dict__.get("_ddtree_width_choice")
        budget, counted = choice.pick(batch.reqs) if choice is not None else (None, False)
        cfg = self._round_config(budget)
        if batch.seq_lens.is_cuda:
            # Carried over from the previous overlap iteration, possibly made on another stream
            # (as DFlashWorkerV2's decode does).
            batch.seq_lens.record_stream(torch.cuda.current_stream(batch.seq_lens.device))
        models = self._scored_models(batch)
        commit_state = None
        if getattr(self, "_need_mamba_verify_commit", False):
            # GDN hybrid: the accepted node's recurrent state, committed after the walk and the
            # stop truncation, before any other target forward (hybrid_state.commit_tree_state).
            from ddtree_runtime.sglang_plugin.round.hybrid_state import commit_tree_state

            def commit_state(accept_index: torch.Tensor, commit_lens: torch.Tensor) -> None:
                commit_tree_state(self.target_worker, batch, accept_index, commit_lens, cfg.verify_rows)

        with self._width_bound(budget):  # a narrower width's own backend and graphs, where it has them
            cells = verify_mask_cells(batch, cfg, runner)
            result = run_tree_round(
                models,
                round_input(batch, draft_input.bonus_tokens, mask_cells=cells),
                cfg,
                req_to_token=runner.req_to_token_pool.req_to_token,
                kv_pool=runner.token_to_kv_pool,
                contract=self._ddtree_contract,
                on_hidden=self._observe_hidden,
                commit_state=commit_state,
                # Published as soon as the lengths are final, before the drafter's context append
                # (DFlashWorkerV2 does the same): the overlap scheduler's next resolve may go on.
                on_lengths=on_publish,
                graphs=self._graphs_for(cfg.budget),
            )
        if counted:
            choice.count(budget, result.commit_lens)  # device add; read back later, asynchronously
        scoring = getattr(self, "_ddtree_scoring", None)
        if scoring:
            scoring.after_tree_round(result.graph_bucket)  # a sampled graph round's draft logits
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

    def _round_config(self, budget: int | None = None) -> Any:
        """The round's configuration at ``budget`` (one of an adaptive server's widths; None: the server's
        budget, its widest). Every width writes the server's one KV window (what SGLang reserves)."""
        from ddtree_runtime.sglang_plugin.gdn_verify_kernel import reuse_parent_on
        from ddtree_runtime.sglang_plugin.round.tree_round import RoundConfig

        runner = self.target_worker.model_runner
        decoder = self.ddtree_settings.decoder
        at = decoder if budget is None or budget == decoder.budget else decoder.at_budget(budget)
        cfg = RoundConfig.from_settings(
            at,
            mask_token_id=int(self._mask_token_id),
            page_size=int(runner.token_to_kv_pool_allocator.page_size),
            depth_first=reuse_parent_on(),  # the rows the parent reuse keeps in registers
        )
        return replace(cfg, window=decoder.kv_window) if at is not decoder else cfg

    def _round_models(self, batch: Any) -> Any:
        """The round's model passes (``tree_round.RoundModels``): SGLang's runners."""
        from ddtree_runtime.sglang_plugin.round.sglang_models import SGLangRoundModels

        return SGLangRoundModels(self, batch)

    def _scored_models(self, batch: Any) -> Any:
        """:meth:`_round_models`, the drafter's head output teed to counterfactual scoring on a sampled
        round."""
        models = self._round_models(batch)
        scoring = getattr(self, "_ddtree_scoring", None)
        return scoring.models(models, int(self.block_size)) if scoring else models

    def _observe_hidden(self, hidden: Any) -> None:
        self._ddtree_handshake.observe(hidden)
        self._publish(self._ddtree_handshake.to_dict())


def _publishing_rank() -> bool:
    """Rank 0 of a tensor-parallel group publishes its gauges (every rank measures the same round)."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return int(getattr(parallel, "attn_tp_rank", getattr(parallel, "tp_rank", 0)) or 0) == 0


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
