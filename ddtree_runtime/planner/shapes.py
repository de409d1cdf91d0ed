"""What SGLang sizes its pools from, read off a target/drafter pair's files (configs + safetensors headers).

Readers: ``ddtree_runtime.core.model_files`` (``read_config``, ``read_checkpoint_tensors``, the files
``load_contract`` reads too), locally, or the same functions' JSON output sent back from a host
(``python3 model_files.py describe TARGET DRAFT``, see :func:`model_pair_from_description`).

Supported targets: dense attention (Qwen3 and friends) and Qwen3-Next / Qwen3.5 / Qwen3.6 Gated
DeltaNet hybrids (full attention every ``full_attention_interval`` layers, as SGLang's
``configs/qwen3_next.py:Qwen3NextConfig.layers_block_type`` lays them out). Anything else with
recurrent state is refused by name rather than planned wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddtree_runtime.core.contract import build_target_layer_ids
from ddtree_runtime.core.model_files import ContractError, read_checkpoint_tensors, read_config

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_SAFETENSORS_FLOAT = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_SAFETENSORS_BYTES = {
    **_SAFETENSORS_FLOAT, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8,
}  # fmt: skip
# Model types SGLang serves as Qwen3-Next-style GDN hybrids (configs/qwen3_next.py, qwen3_5.py).
_GDN_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
_OTHER_RECURRENT = ("mamba", "jamba", "nemotron_h", "falcon_h1", "zamba", "bamba", "granitemoehybrid", "lfm2")


class PlanError(ValueError):
    """Inputs the planner cannot plan from (bad files, unknown GPU, impossible flags): say what and why."""


@dataclass(frozen=True)
class WeightTable:
    """Checkpoint bytes SGLang loads, at the model dtype, split by how tensor parallelism shares them."""

    sharded_bytes: int  # >= 2-D tensors: split over the TP ranks (linear, embedding, conv weights)
    replicated_bytes: int  # 1-D tensors: norms, biases, gates (every rank holds them)
    skipped_bytes: int = 0  # in the checkpoint but not loaded (e.g. Qwen3.5's MTP head)
    skipped: tuple[str, ...] = ()

    def per_rank(self, tp: int) -> int:
        return self.replicated_bytes + -(-self.sharded_bytes // tp)

    @property
    def total(self) -> int:
        return self.sharded_bytes + self.replicated_bytes


@dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet geometry; SGLang's state shapes come from it (configs/mamba_utils.py)."""

    layers: tuple[int, ...]
    num_value_heads: int
    num_key_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    def conv_dim(self, tp: int) -> int:
        """``Mamba2StateShape.create``: conv over [q, k, v]; key groups widen when TP does not divide them."""
        groups = self.num_key_heads
        if groups % tp:
            groups += tp - groups  # extra_groups_for_head_shards
        return self.value_head_dim * self.num_value_heads + 2 * groups * self.key_head_dim

    def check_tp(self, tp: int) -> None:
        if self.num_value_heads % tp or self.conv_dim(tp) % tp:
            raise PlanError(
                f"tp-size {tp} does not divide the target's {self.num_value_heads} GDN value heads "
                f"(conv width {self.conv_dim(tp)}): SGLang's Mamba2StateShape.create refuses it; "
                "use a tp-size that divides them"
            )

    def state_bytes_per_slot(self, tp: int, *, ssm_bytes: int, conv_bytes: int = 2) -> int:
        """``BaseLinearStateParams.mamba_cache_per_req``: conv + SSM state of every GDN layer, one slot."""
        conv = (self.conv_dim(tp) // tp) * (self.conv_kernel - 1) * conv_bytes
        ssm = (self.num_value_heads // tp) * self.value_head_dim * self.key_head_dim * ssm_bytes
        return (conv + ssm) * len(self.layers)


@dataclass(frozen=True)
class TargetModel:
    path: str
    architecture: str
    model_type: str
    num_layers: int
    full_attention_layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: str
    context_length: int
    weights: WeightTable
    linear: LinearAttention | None = None
    config_ssm_dtype: str | None = None
    multimodal: bool = False
    vision_layers: int = 0
    vision_hidden: int = 0
    vocab_size: int = 0  # the LM head's rows (the drafter borrows it); 0 when the config names none

    @property
    def hybrid(self) -> bool:
        return self.linear is not None

    def kv_heads_per_rank(self, tp: int) -> int:
        """``ModelConfig.get_num_kv_heads``: KV heads split over TP, replicated once TP outgrows them."""
        return max(1, self.num_kv_heads // tp)

    def kv_bytes_per_token(self, tp: int, kv_bytes: int) -> int:
        """``DefaultPoolConfigurator._compute_cell_size``: K + V of the full-attention layers only."""
        return (
            self.kv_heads_per_rank(tp)
            * (self.head_dim + self.v_head_dim)
            * len(self.full_attention_layers)
            * kv_bytes
        )


@dataclass(frozen=True)
class DraftModel:
    path: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    block_size: int
    dtype: str
    weights: WeightTable

    def kv_bytes_per_token(self, tp: int, kv_bytes: int) -> int:
        """``dflash_utils.dflash_draft_cell_size_per_token``: every drafter layer, full K + V."""
        return (
            max(1, self.num_kv_heads // tp) * (self.head_dim + self.v_head_dim) * self.num_layers * kv_bytes
        )


@dataclass(frozen=True)
class ModelPair:
    target: TargetModel
    draft: DraftModel
    warnings: tuple[str, ...] = field(default=())


# ---------------------------------------------------------------------------------------------


def load_model_pair(target_dir: str | Path, draft_dir: str | Path) -> ModelPair:
    """Read both directories (configs and safetensors headers only)."""
    try:
        description = {
            "target": {
                "path": str(target_dir),
                "config": read_config(target_dir, "target"),
                "tensors": read_checkpoint_tensors(target_dir, "target"),
            },
            "draft": {
                "path": str(draft_dir),
                "config": read_config(draft_dir, "draft"),
                "tensors": read_checkpoint_tensors(draft_dir, "draft"),
            },
        }
    except ContractError as exc:
        raise PlanError(str(exc)) from None
    return model_pair_from_description(description)


def model_pair_from_description(doc: dict[str, Any]) -> ModelPair:
    """Build the pair from ``model_files.py describe`` output (configs + tensor tables)."""
    if not isinstance(doc, dict) or "error" in doc:
        raise PlanError(f"cannot read the model files: {doc.get('error') if isinstance(doc, dict) else doc}")
    try:
        target_doc, draft_doc = doc["target"], doc["draft"]
        target = _target(target_doc["path"], target_doc["config"], target_doc["tensors"])
        draft = _draft(draft_doc["path"], draft_doc["config"], draft_doc["tensors"], target)
    except (KeyError, TypeError, AttributeError) as exc:
        raise PlanError(
            f"malformed model description ({type(exc).__name__}: {str(exc)[:80]}): expected `model_files.py "
            "describe` output"
        ) from None
    except ContractError as exc:
        raise PlanError(str(exc)) from None
    return ModelPair(target=target, draft=draft)


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _pick(cfg: dict[str, Any], root: dict[str, Any], name: str, default: Any = None) -> Any:
    value = cfg.get(name)
    if value is None:
        value = root.get(name)
    return default if value is None else value


# What a real checkpoint's config can plausibly hold: beyond these an input is absurd (and a range over it
# would take all memory), so it is refused rather than planned.
MAX_LAYERS = 4096
MAX_WIDTH = 1 << 17  # hidden sizes, head dims, state dims
MAX_HEADS = 4096
MAX_BLOCK = 1024
MAX_CONTEXT = 1 << 26
MAX_TENSOR_DIM = 1 << 40
MAX_CHECKPOINT_BYTES = 1 << 50


def _positive_int(path: str, value: Any, name: str, high: int = MAX_WIDTH) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise PlanError(f"{path}/config.json: {name} must be an integer in 1..{high}, got "
                        f"{str(value)[:40]!r}")
    return value


def _dtype(cfg: dict[str, Any], root: dict[str, Any]) -> str:
    raw = _pick(cfg, root, "dtype") or _pick(cfg, root, "torch_dtype") or "bfloat16"
    name = {
        "bf16": "bfloat16",
        "fp16": "float16",
        "half": "float16",
        "float": "float32",
        "fp32": "float32",
    }.get(str(raw).removeprefix("torch."), str(raw).removeprefix("torch."))
    if name not in DTYPE_BYTES:
        raise PlanError(f"unsupported model dtype {raw!r}: the planner knows {', '.join(DTYPE_BYTES)}")
    return name


def _weights(tensors: dict[str, Any], dtype: str, *, skip: tuple[str, ...] = ()) -> WeightTable:
    """Bytes per tensor at the loaded dtype: SGLang casts floating checkpoints to the model dtype."""
    sharded = replicated = skipped = 0
    skipped_names: set[str] = set()
    model_bytes = DTYPE_BYTES[dtype]
    if not isinstance(tensors, dict):
        raise PlanError(f"the tensor table is not a mapping of name -> {{dtype, shape}}: "
                        f"{str(tensors)[:60]!r}")
    total = 0
    for name, entry in tensors.items():
        raw = entry.get("shape") if isinstance(entry, dict) else None
        if (not isinstance(raw, list) or len(raw) > 8
                or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_TENSOR_DIM
                           for d in raw)):
            raise PlanError(f"tensor {str(name)[:80]!r} has an impossible shape {str(raw)[:60]}: a list "
                            "of at most 8 sizes, each 0 or more")
        shape = list(raw)
        kind = str(entry["dtype"])
        numel = 1
        for s in shape:
            numel *= s
        size = numel * (model_bytes if kind in _SAFETENSORS_FLOAT else _SAFETENSORS_BYTES.get(kind, 1))
        total += size
        if total > MAX_CHECKPOINT_BYTES:
            raise PlanError(f"the checkpoint's tensors add up to more than {MAX_CHECKPOINT_BYTES >> 40} TiB: "
                            "not a model the planner can place")
        hit = next((s for s in skip if s in name), None)
        if hit is not None or "rotary_emb.inv_freq" in name:
            skipped += size
            skipped_names.add(hit or "rotary_emb.inv_freq")
        elif len(shape) >= 2:
            sharded += size
        else:
            replicated += size
    return WeightTable(sharded, replicated, skipped, tuple(sorted(skipped_names)))


def _target(path: str, config: dict[str, Any], tensors: dict[str, Any]) -> TargetModel:
    text = _text_config(config)
    where = path
    model_type = str(text.get("model_type") or config.get("model_type") or "")
    root_type = str(config.get("model_type") or model_type)
    archs = config.get("architectures") or []
    arch = str(archs[0]) if isinstance(archs, list) and archs else model_type
    layers = _positive_int(where, _pick(text, config, "num_hidden_layers"), "num_hidden_layers", MAX_LAYERS)
    hidden = _positive_int(where, _pick(text, config, "hidden_size"), "hidden_size")
    heads = _positive_int(where, _pick(text, config, "num_attention_heads"), "num_attention_heads", MAX_HEADS)
    kv_heads = _positive_int(where, _pick(text, config, "num_key_value_heads", heads), "num_key_value_heads",
                             MAX_HEADS)
    head_dim = _positive_int(where, _pick(text, config, "head_dim", hidden // heads), "head_dim")
    dtype = _dtype(text, config)
    context = _positive_int(where, _pick(text, config, "max_position_embeddings", 32768),
                            "max_position_embeddings", MAX_CONTEXT)

    linear = None
    full = tuple(range(layers))
    gdn = any(t.startswith(g) for t in (model_type, root_type) for g in _GDN_MODEL_TYPES)
    if gdn:
        interval = _positive_int(
            where, _pick(text, config, "full_attention_interval", 4), "full_attention_interval", MAX_LAYERS
        )
        full = tuple(i for i in range(layers) if (i + 1) % interval == 0)
        linear = LinearAttention(
            layers=tuple(i for i in range(layers) if (i + 1) % interval != 0),
            num_value_heads=_positive_int(
                where, _pick(text, config, "linear_num_value_heads"), "linear_num_value_heads", MAX_HEADS
            ),
            num_key_heads=_positive_int(
                where, _pick(text, config, "linear_num_key_heads"), "linear_num_key_heads", MAX_HEADS
            ),
            key_head_dim=_positive_int(
                where, _pick(text, config, "linear_key_head_dim"), "linear_key_head_dim"
            ),
            value_head_dim=_positive_int(
                where, _pick(text, config, "linear_value_head_dim"), "linear_value_head_dim"
            ),
            conv_kernel=_positive_int(
                where, _pick(text, config, "linear_conv_kernel_dim", 4), "linear_conv_kernel_dim", 64
            ),
        )
    elif any(t.startswith(o) for t in (model_type, root_type) for o in _OTHER_RECURRENT) or any(
        str(t).lower() in ("mamba", "mamba2", "linear_attention") for t in (text.get("layer_types") or [])
    ):
        raise PlanError(
            f"{path}: model type {root_type!r} keeps recurrent state the planner does not size; "
            "it knows dense "
            "attention targets and Qwen3-Next/Qwen3.5/Qwen3.6 Gated DeltaNet hybrids"
        )
    vision = config.get("vision_config") if isinstance(config.get("vision_config"), dict) else None
    # Qwen3.5/3.6 checkpoints carry an MTP head SGLang skips unless it drafts with it
    # (models/qwen3_5.py load_weights: `if "mtp" in name: continue`); a *ForCausalLM skips the vision tower.
    skip = ("mtp",) if gdn else ()
    if vision is not None and "ConditionalGeneration" not in arch:
        skip = (*skip, "visual")
    ssm_dtype = text.get("mamba_ssm_dtype") or config.get("mamba_ssm_dtype")
    return TargetModel(
        path=path,
        architecture=arch,
        model_type=root_type,
        num_layers=layers,
        full_attention_layers=full,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=dtype,
        context_length=context,
        weights=_weights(tensors, dtype, skip=skip),
        linear=linear,
        config_ssm_dtype=str(ssm_dtype) if ssm_dtype else None,
        multimodal=vision is not None and "ConditionalGeneration" in arch,
        # adjust_mem_fraction_for_vlm reads vision_config.num_hidden_layers (24 when absent, as for
        # Qwen3.5's vision tower, which names it `depth`): the planner reads it the same way.
        vision_layers=_positive_int(where, vision.get("num_hidden_layers") or 24,
                                    "vision_config.num_hidden_layers", MAX_LAYERS) if vision else 0,
        vision_hidden=_positive_int(where, vision.get("hidden_size"), "vision_config.hidden_size")
        if vision and vision.get("hidden_size") is not None else 0,
        vocab_size=_vocab_size(_pick(text, config, "vocab_size", 0)),
    )


def _vocab_size(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _draft(path: str, config: dict[str, Any], tensors: dict[str, Any], target: TargetModel) -> DraftModel:
    layers = _positive_int(path, config.get("num_hidden_layers"), "num_hidden_layers", MAX_LAYERS)
    hidden = _positive_int(path, config.get("hidden_size"), "hidden_size")
    heads = _positive_int(
        path, config.get("num_attention_heads", config.get("num_key_value_heads")), "num_attention_heads",
        MAX_HEADS,
    )
    kv_heads = _positive_int(path, config.get("num_key_value_heads", heads), "num_key_value_heads", MAX_HEADS)
    head_dim = _positive_int(path, config.get("head_dim", hidden // heads), "head_dim")
    dflash = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    block = dflash.get("block_size", config.get("block_size"))
    if block is None:
        block = 16  # SGLang's DFLASH default when the draft config names none (with a warning)
    block = _positive_int(path, block, "block_size", MAX_BLOCK)
    if dflash.get("target_layer_ids") is None:
        build_target_layer_ids(target.num_layers, layers)  # same refusal as the contract for tiny targets
    dtype = _dtype(config, config) if (config.get("dtype") or config.get("torch_dtype")) else target.dtype
    return DraftModel(
        path=path,
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        block_size=block,
        dtype=dtype,
        weights=_weights(tensors, dtype),
    )
