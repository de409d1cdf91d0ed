"""Start-up checks the DDTREE worker runs before it serves: the hidden-state width contract, and the
configurations a tree round cannot serve, each refused with the reason and what starts instead.

``ddtree_worker.DDTreeWorker`` calls them at construction (launch flags, model files) and in
``init_cuda_graphs`` (what only the built DFlash worker, its pools and backends know).
"""

from __future__ import annotations

import os
from typing import Any

from ddtree_runtime.core.contract import HiddenContract, load_contract
from ddtree_runtime.core.decoder_settings import DecoderSettings
from ddtree_runtime.core.model_files import ContractError
from ddtree_runtime.sglang_plugin.algorithm import PluginSettings, is_chain
from ddtree_runtime.sglang_plugin.refusals.resolution import GDN, DDTreeConfigError, hybrid_kind, kind_note


def startup_contract(target_path: str, draft_path: str) -> HiddenContract | None:
    """The width check at worker start, from the files: raises ContractError when the drafter's
    ``fc`` does not take what the target captures. None when the models are not local directories
    (hub ids): ``loaded_contract`` then states it from the loaded models."""
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
            f"({len(layer_ids)} target layers x {target_hidden}): is this drafter made for this "
            "target? Point --speculative-draft-model-path at the drafter trained on it.",
            expected=fc_in_features,
            capture_width=width,
        )


def loaded_contract(target_runner: Any, draft_model: Any, settings: PluginSettings) -> HiddenContract:
    """The width contract as SGLang loaded it: the layers the target's runner captures for the
    drafter (``spec_aux_config``), the target's hidden size and the drafter's ``fc``. Every server
    gets it, hub ids included; raises ContractError on a mismatch, before any forward."""
    model_config = target_runner.model_config
    layer_ids = getattr(target_runner.spec_aux_config, "dflash_target_layer_ids", None)
    fc = draft_model.fc
    fc_in = int(getattr(fc, "in_features", None) or fc.input_size)  # nn.Linear or ReplicatedLinear
    hidden = int(model_config.hidden_size)
    if not layer_ids:
        # Without layer ids SGLang hands the drafter the target's last hidden state, [N, hidden]: the
        # message says so in the words (and numbers) the rollout's diagnosis reads.
        raise ContractError(
            "hidden_width_mismatch",
            f"drafter fc expects [N, {fc_in}] but the target captures [N, {hidden}] (hidden_width_mismatch: "
            "the target's runner has no DFlash target layer ids, so the drafter would get the target's "
            "last hidden state): is the algorithm treated as DFlash-family? Check that the ddtree plugin "
            "is loaded (SGLANG_PLUGINS) in the scheduler processes.",
            expected=fc_in,
            capture_width=hidden,
        )
    check_loaded_widths(hidden, list(layer_ids), fc_in)
    return HiddenContract(
        target_hidden_size=hidden,
        target_num_layers=int(model_config.num_hidden_layers),
        target_layer_ids=tuple(int(i) for i in layer_ids),
        block_size=settings.decoder.block_size,
        draft_hidden_size=int(draft_model.config.hidden_size),
        fc_in_features=fc_in,
        mask_token_id=None,
        hybrid=settings.hybrid_kind is not None,
    )

class TreeDecodeNotAvailable(DDTreeConfigError):
    """A configuration the tree decode round cannot serve (the message says why and what starts)."""


def check_tree_decode_support(settings: PluginSettings, cfg: Any) -> None:
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


def check_tree_worker_features(settings: PluginSettings, worker: Any) -> None:
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


def _hybrid_tree_problems(settings: PluginSettings, runner: Any) -> list[str]:
    """A recurrent-state target: only GDN layers, with dense per-row scratch wide enough."""
    from ddtree_runtime.sglang_plugin.round.hybrid_state import HybridScratchError, check_tree_scratch

    kind = hybrid_kind(runner.model_config)
    if kind != GDN:
        return [f"a hybrid target with {kind_note(str(kind))}"]
    try:
        check_tree_scratch(runner.req_to_token_pool, settings.decoder.verify_rows)
    except HybridScratchError as exc:
        return [f"a GDN hybrid target whose state pool cannot hold a tree: {exc}"]
    return []


def _tree_refusal(settings: PluginSettings, hits: list[str]) -> str:
    decoder = settings.decoder
    chain = DecoderSettings.chain(decoder.block_size)
    return (
        f"DDTREE cannot run a tree (budget {decoder.budget}, top-k cap {decoder.topk_cap}) "
        "with:\n  - " + "\n  - ".join(hits) + "\nWhat starts: drop the flag named above, or run "
        f"the chain case --speculative-ddtree-topk-cap 1 --speculative-ddtree-budget {chain.budget} "
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
