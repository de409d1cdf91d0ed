"""Start-up refusals at argument resolution: configurations DDTREE cannot serve correctly, each with the
reason.

Every check reads SGLang's resolving view (``cfg``), so it sees defaults and earlier
resolution decisions exactly as SGLang does. Each entry names the SGLang 0.5.23 site that
would otherwise mis-handle DDTREE (docs/sglang-plugin-sites.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Tree verify needs an arbitrary ancestor mask in the target forward. SGLang's Triton backend
# takes ``custom_mask`` for EAGLE trees; DFlash skips the mask on FlashInfer/FA3/TRTLLM
# (dflash_utils._DFLASH_VERIFY_SKIP_CUSTOM_MASK_BACKENDS), so a tree there would attend to
# its siblings silently. Same choice as sgl-project/sglang#29907.
TREE_MASK_ATTENTION_BACKENDS = ("triton",)


class DDTreeConfigError(ValueError):
    """A launch configuration DDTREE refuses; the message says what to change."""


@dataclass(frozen=True)
class Refusal:
    site: str  # SGLang file:line (0.5.23) whose DFLASH-only check this refusal stands in for
    applies: Callable[[Any], bool]
    message: str


def _on(name: str) -> Callable[[Any], bool]:
    return lambda cfg: bool(getattr(cfg, name, None))


REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "disaggregation/mooncake/conn.py:949",
        lambda cfg: (getattr(cfg, "disaggregation_mode", "null") or "null") != "null",
        "DDTREE runs colocated only: drop --disaggregation-mode (SGLang's PD transfer code matches "
        "the name DFLASH, and DDTREE has no disaggregated draft input).",
    ),
    Refusal(
        "arg_groups/kv_cache_hook.py:593,647",
        _on("enable_unified_memory"),
        "DDTREE does not support --enable-unified-memory: SGLang audited the unified pool's "
        "location translation for DFLASH's prefix commit only, not for a tree's scattered commit.",
    ),
    Refusal(
        "arg_groups/speculative_hook.py:176",
        _on("speculative_use_block_verification"),
        "DDTREE verifies a tree, not a block: drop --speculative-use-block-verification.",
    ),
    Refusal(
        "mem_cache/kv_cache_configurator.py:1711, arg_groups/attention_hook.py:480",
        _on("enable_linear_replayssm_spec"),
        "DDTREE does not support --enable-linear-replayssm-spec (a linear-attention replay path "
        "for DFLASH/DSPARK chains; tree nodes need per-node recurrent state).",
    ),
    Refusal(
        "arg_groups/layernorm_sp_hook.py:179",
        _on("enable_layernorm_sp"),
        "DDTREE does not support --enable-layernorm-sp (SGLang gathers the sequence-sharded "
        "hidden states only for Muse Spark DFLASH).",
    ),
    Refusal(
        "arg_groups/cp_tp_group_sharing_hook.py:58,92",
        _on("enable_cp_tp_group_sharing"),
        "DDTREE does not support --enable-cp-tp-group-sharing (ported for GLM-5.3 DFLASH/MTP only).",
    ),
    Refusal(
        "arg_groups/lora_hook.py:252",
        lambda cfg: bool(getattr(cfg, "enable_lora", None)) or bool(getattr(cfg, "lora_paths", None)),
        "DDTREE does not support LoRA adapters: SGLang's LoRA segment layout is audited for "
        "EAGLE/EAGLE3/DFLASH/DSPARK verify widths only. Drop --enable-lora / --lora-paths.",
    ),
    Refusal(
        "arg_groups/validation_hook.py:694",
        _on("enable_return_aux_hidden_states"),
        "--enable-return-aux-hidden-states captures without a draft and needs EAGLE3, DFLASH or "
        "DSPARK to name the convention; it cannot be combined with DDTREE.",
    ),
    Refusal(
        "mem_cache/hybrid_cache/hybrid_pool_assembler.py:1784",
        _on("enable_hierarchical_cache"),
        "DDTREE does not support --enable-hierarchical-cache yet: the fused hierarchical draft KV "
        "path is written for DFLASH's contiguous commit.",
    ),
)


def check_refusals(cfg: Any) -> None:
    """Raise DDTreeConfigError naming every refused flag in ``cfg``."""
    hits = [r.message for r in REFUSALS if r.applies(cfg)]
    for name in ("attention_backend", "decode_attention_backend", "prefill_attention_backend"):
        backend = getattr(cfg, name, None)
        if backend is not None and backend not in TREE_MASK_ATTENTION_BACKENDS:
            hits.append(
                f"DDTREE needs an attention backend that applies the tree mask in the verify pass; "
                f"--{name.replace('_', '-')} is {backend!r}. Use --attention-backend "
                f"{' or '.join(TREE_MASK_ATTENTION_BACKENDS)}."
            )
    if hits:
        raise DDTreeConfigError("DDTREE cannot start with this configuration:\n  - " + "\n  - ".join(hits))


HYBRID_REASON = (
    "In a recurrent layer the state advances token by token in row order, so an attention mask "
    "cannot keep sibling tree nodes apart: every tree node needs its own recurrent state (read from "
    "its parent, written to its own row) and the accepted leaf's state must be committed afterwards. "
    "SGLang 0.5.23 does that only for Gated DeltaNet layers (parent-pointer conv and recurrent "
    "kernels, per-row scratch, tree-aware commit), which DDTREE uses."
)
GDN = "gdn"
TREE_HYBRID_KINDS = (GDN,)  # hybrid kinds whose tree verify and commit DDTREE runs
KIND_NOTES = {
    GDN: "Gated DeltaNet layers (Qwen3-Next / Qwen3.5 / Qwen3.6)",
    "mamba2": (
        "Mamba / Mamba2 (SSD) layers (Nemotron-H, Falcon-H1, LFM2, Granite hybrids, ...): SGLang "
        "0.5.23's Mamba2 verify path (FlashInfer or Triton SSD kernels) takes no parent pointers"
    ),
    "kda": (
        "Kimi Delta Attention layers (Kimi-Linear, Bailing KDA, GLM-5 Next): their tree verify was "
        "not audited for DDTREE's trees"
    ),
    "lightning": "lightning-attention (seg_la) layers (Bailing / MiniCPM hybrids): no tree verify kernel",
}


def hybrid_kind(model_config: Any) -> str | None:
    """SGLang's own classification of a target's recurrent layers: ``"gdn"``, ``"mamba2"``,
    ``"kda"``, ``"lightning"``, ``"linear-attention:<spec>"`` (a registry model), or None (pure
    attention)."""
    from sglang.srt.configs import hybrid_arch

    for kind, probe in (
        ("mamba2", hybrid_arch.mamba2_config),
        (GDN, hybrid_arch.hybrid_gdn_config),
        ("kda", hybrid_arch.hybrid_kda_config),
        ("lightning", hybrid_arch.hybrid_lightning_config),
    ):
        if probe(model_config) is not None:
            return kind
    if hybrid_arch.mambaish_config(model_config) is None:
        return None
    spec = hybrid_arch.linear_attn_model_spec(model_config)
    return f"linear-attention:{getattr(spec, 'name', None) or type(spec).__name__}"


def kind_note(kind: str) -> str:
    return KIND_NOTES.get(kind, f"{kind} layers: not audited for DDTREE's trees")


def check_hybrid(
    target_path: str,
    kind: str | None,
    config_class: str = "",
    *,
    allow_hybrid: bool,
    chain: bool,
    block: int,
) -> None:
    """The hybrid gate.

    * pure attention, and GDN hybrids (Qwen3-Next / Qwen3.5 / Qwen3.6): start, trees included;
    * every other recurrent kind: refused, naming what starts instead;
    * ``--speculative-ddtree-allow-hybrid`` starts such a kind in the chain case only (top-k cap 1,
      budget = block - 1), which DFlash's own code decodes and commits; it never starts a tree on
      an unaudited kind. On GDN hybrids it changes nothing.
    """
    if kind is None or kind in TREE_HYBRID_KINDS:
        return
    if allow_hybrid and chain:
        return
    chain_flags = f"--speculative-ddtree-topk-cap 1 --speculative-ddtree-budget {block - 1}"
    what_starts = (
        f"What starts instead: --speculative-algorithm DFLASH, or DDTREE's chain case ({chain_flags} "
        "--speculative-ddtree-allow-hybrid), which DFlash's own code decodes."
    )
    if allow_hybrid:
        raise DDTreeConfigError(
            f"DDTREE refuses a tree on the hybrid target {target_path} ({config_class}: "
            f"{kind_note(kind)}). --speculative-ddtree-allow-hybrid starts the chain case only. "
            f"{HYBRID_REASON} {what_starts}"
        )
    raise DDTreeConfigError(
        f"DDTREE refuses the hybrid target {target_path} ({config_class}: {kind_note(kind)}). "
        f"{HYBRID_REASON} {what_starts}"
    )
