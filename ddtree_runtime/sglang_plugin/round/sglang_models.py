"""``tree_round.RoundModels`` on SGLang's GPU model runners: the DFlash drafter's block pass and
the target's tree-masked verify pass, built the way ``DFlashWorkerV2.forward_batch_generation``
builds its own (0.5.23), with the tree's width, mask and positions.

Run for real in SGLang 0.5.23's own scheduler on CPU (tests/sglang/test_real_server.py, lab host
ct131): trees token-identical to the server without speculation, batched and with requests joining a
running batch; the CPU run uses the lab's torch_native tree verify (docs/sglang-cpu-lab.md). On the
H200 (the GPU lab, docs/sglang-gpu-lab.md) the target verify replays graphs captured for trees
(``graph_sites``) with SGLang's Triton backend. Everything it hands to (tree, walk,
commit, gather) is also tested on CPU with SGLang's real pools (tests/sglang/test_tree_decode.py).
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.runtime_context import get_parallel
from sglang.srt.speculative.dflash_utils import apply_dflash_verify_logits_adjustments
from sglang.srt.speculative.dflash_worker_v2 import _resolve_dflash_embedding_module
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_utils import draft_tp_context
from torch import Tensor

from ddtree_runtime.core.tree_types import DraftTopK
from ddtree_runtime.sglang_plugin.ddtree_info import DDTreeVerifyInput
from ddtree_runtime.sglang_plugin.round.bounds import host_length_bound
from ddtree_runtime.sglang_plugin.round.draft_head import draft_head
from ddtree_runtime.sglang_plugin.round.tree_step import TreeVerifyBatch


class SGLangRoundModels:
    """One round's model passes for ``DDTreeWorker`` (see module docstring)."""

    def __init__(self, worker: Any, batch: Any) -> None:
        self.worker = worker
        self.batch = batch
        self.draft_hidden_rows: int | None = None
        self.last_target_out: Any = None

    # --- drafter: DFlash's block, unchanged ---------------------------------------------------
    def draft_block(
        self, block_ids: Tensor, positions: Tensor, cache_loc: Tensor, req_pool_indices: Tensor
    ) -> Tensor | DraftTopK:
        w = self.worker
        hidden = self._draft_forward(block_ids, positions, cache_loc, req_pool_indices)
        bs, block = block_ids.shape
        lm_head = w.target_worker.model_runner.model.lm_head
        vocab = int(w.model_runner.model_config.vocab_size)
        decoder = w.ddtree_settings.decoder
        with draft_tp_context(w.draft_parallel_layout):
            rows = hidden[:, 1:].reshape(-1, hidden.shape[-1])
            # TP: a vocabulary shard per rank, top-K + logsumexp exchanged (draft_head, tp_head)
            head = draft_head(
                rows, lm_head, vocab, get_parallel().tp_group,
                # An adaptive server's widest budget whatever the round's width: a narrower tree builds
                # from the same lists, and counterfactual scoring's candidates rank with this K.
                budget=decoder.budget, topk_cap=decoder.topk_cap,
            )
        if isinstance(head, DraftTopK):
            return head.reshape(bs, block - 1)  # depths 1..L only
        logits = head.view(bs, block - 1, -1)
        root = torch.zeros((bs, 1, logits.shape[-1]), dtype=logits.dtype, device=logits.device)
        return torch.cat([root, logits], dim=1).view(bs * block, -1)  # slot 0 (bonus) is not read

    def draft_hidden(
        self, block_ids: Tensor, positions: Tensor, cache_loc: Tensor, req_pool_indices: Tensor
    ) -> Tensor:
        """The drafter's depth rows ``[b, L, H]`` without the head (the round's graphs hold it)."""
        return self._draft_forward(block_ids, positions, cache_loc, req_pool_indices)[:, 1:]

    def _draft_forward(
        self, block_ids: Tensor, positions: Tensor, cache_loc: Tensor, req_pool_indices: Tensor
    ) -> Tensor:
        """The DFlash drafter over the block -> its hidden states ``[b, block, H]``."""
        w, batch = self.worker, self.batch
        bs, block = block_ids.shape
        target_model = w.target_worker.model_runner.model
        if w._full_embed_gpu is not None:
            embeds = torch.nn.functional.embedding(block_ids, w._full_embed_gpu)
        else:
            embeds = _resolve_dflash_embedding_module(w.draft_model, target_model)(block_ids)
        if w._noise_embed_scale != 1.0:
            embeds = embeds * w._noise_embed_scale
        prefix = batch.seq_lens
        # Host sizes from bounds, never from the device (DFlashWorkerV2's decode does the same):
        # under the overlap scheduler batch.seq_lens_cpu is None and the reserved lengths stand in.
        seq_lens_cpu, seq_lens_sum = host_length_bound(batch, block)
        plan = w.target_worker.model_runner.kv_index_translator.plan(
            req_pool_indices=req_pool_indices,
            seq_lens=prefix,
            seq_lens_cpu=seq_lens_cpu,
            write_virtual=cache_loc,
            read_extent=block,
        )
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            input_ids=block_ids.flatten(),
            req_pool_indices=req_pool_indices,
            seq_lens=prefix,
            out_cache_loc=cache_loc,
            seq_lens_sum=seq_lens_sum,
            seq_lens_cpu=seq_lens_cpu,
            positions=positions.reshape(-1),
            input_embeds=embeds.view(-1, embeds.shape[-1]),
            spec_algorithm=SpeculativeAlgorithm.DFLASH,  # the drafter's own pass is DFlash's
            spec_info=w._draft_block_spec_info,
            capture_hidden_mode=CaptureHiddenMode.NULL,
            global_num_token_non_padded_cpu=bs * block,
            can_run_decode_cuda_graph=batch.can_run_decode_cuda_graph,
        )
        plan.bind(forward_batch, w.draft_model_runner.kv_index_translator)
        with torch.inference_mode(), draft_tp_context(w.draft_parallel_layout):
            out = w.draft_model_runner.forward(forward_batch)
        hidden = out.logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTREE: the DFlash drafter returned no hidden states for its block.")
        return hidden.view(bs, block, -1)

    # --- target: one verify over the tree --------------------------------------------------
    def target_verify(
        self, plan: TreeVerifyBatch, cache_loc: Tensor, req_pool_indices: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        w, batch = self.worker, self.batch
        rows = plan.draft_token_num
        seq_lens_cpu, seq_lens_sum = host_length_bound(batch, rows)
        kv_plan = w.target_worker.model_runner.kv_index_translator.plan(
            req_pool_indices=req_pool_indices,
            seq_lens=batch.seq_lens,
            seq_lens_cpu=seq_lens_cpu,
            write_virtual=cache_loc,
            read_extent=rows,
        )
        verify = DDTreeVerifyInput(
            draft_token=plan.draft_token,
            positions=plan.positions,  # prefix + depth: siblings share a position
            draft_token_num=rows,
            custom_mask=plan.custom_mask,  # ancestor-only tree block, prefix visible
            capture_hidden_mode=CaptureHiddenMode.FULL,
            kv_loc_plan=kv_plan,
            # GDN layers (hybrid targets): the tree's links, rows in parent-before-child order
            retrieve_next_token=plan.retrieve_next_token,
            retrieve_next_sibling=plan.retrieve_next_sibling,
        )
        batch.out_cache_loc = cache_loc
        saved = batch.seq_lens_cpu, batch.seq_lens_sum
        batch.seq_lens_cpu, batch.seq_lens_sum = seq_lens_cpu, seq_lens_sum  # host bounds for the verify
        # The batch goes into the target-verify graph's static buffers here when a graph was
        # captured for this width and batch size (graph_sites: captured with the tree mask and
        # the GDN tree kernels), else the attention metadata is planned eagerly: either way the
        # forward must not plan it again (DFLASH passes the same flag, dflash_worker_v2 ~2879).
        forward_batch, _ = verify.prepare_for_verify(batch, w.target_worker)
        batch.seq_lens_cpu, batch.seq_lens_sum = saved
        out = w.target_worker.forward_batch_generation(
            batch=None, forward_batch=forward_batch, is_verify=True, skip_attn_backend_init=True
        )
        self.last_target_out = out
        logits_output = out.logits_output
        logits = logits_output.next_token_logits
        target_lp = w._target_logits_processor
        if target_lp is not None and target_lp.is_deferred_shard(logits):
            logits = target_lp.finish_deferred_gather(logits)  # global vocabulary ids
        # The request's own logit processors, penalties and bias, per verify row, as DFlash does
        # (penalties see the committed prefix, not a row's tree ancestors: DFlash's approximation).
        apply_dflash_verify_logits_adjustments(
            next_token_logits=logits, sampling_info=batch.sampling_info, draft_token_num=rows
        )
        logits_output.next_token_logits = logits  # global ids, adjusted: what logprobs score
        hidden = logits_output.hidden_states
        logits_output.hidden_states = None  # consumed this round (the next forward reuses it)
        return logits, hidden

    # --- drafter context: accepted rows by node index ---------------------------------------
    def append_draft_context(
        self, hidden: Tensor, cache_loc_2d: Tensor, positions: Tensor, commit_lens: Tensor
    ) -> None:
        # DFlash's prefix-valid writer: dense [b, L+1] slots + commit_lens, no packed index tensor.
        self.worker._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=hidden,
            cache_loc=cache_loc_2d.reshape(-1),
            cache_loc_2d=cache_loc_2d,
            positions=positions,
            commit_lens=commit_lens,
        )
