"""The hidden-state handshake between a target model and its DFlash-family drafter.

The drafter's ``fc`` takes the target's hidden states at ``target_layer_ids`` concatenated on the
last dim: ``[N, len(ids) * H_target]``. This module states that width from the files alone (the
two ``config.json`` files and the drafter's safetensors header, read by
:mod:`ddtree_runtime.core.model_files`; no tensor is loaded);
:mod:`ddtree_runtime.core.hidden_states` checks a live tensor against it. Every failure is one
``ContractError`` (defined in ``model_files``, which must stand alone on a host) whose message names
the numbers and the likely cause. It imports nothing of ours outside core and no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ddtree_runtime.core.model_files import ContractError, find_fc_weight, read_config

__all__ = [
    "HiddenContract",
    "build_target_layer_ids",
    "load_contract",
]

# Model dimensions SGLang indexes with int32: anything larger is a corrupt or hostile config.
MAX_COUNT = 2**31 - 1
_HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_next", "mamba", "jamba", "nemotron_h", "falcon_h1", "zamba", "bamba")
_HYBRID_LAYER_TYPES = ("linear_attention", "mamba", "mamba2", "gated_deltanet", "recurrent")


@dataclass(frozen=True)
class HiddenContract:
    target_hidden_size: int
    target_num_layers: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    draft_hidden_size: int
    fc_in_features: int
    mask_token_id: int | None
    hybrid: bool  # target has linear-attention / mamba layers
    warnings: tuple[str, ...] = ()

    @property
    def capture_width(self) -> int:
        return len(self.target_layer_ids) * self.target_hidden_size

    @property
    def horizon(self) -> int:
        """Draft horizon L = block_size - 1."""
        return self.block_size - 1

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["target_layer_ids"] = list(self.target_layer_ids)
        out["warnings"] = list(self.warnings)
        out["capture_width"] = self.capture_width
        return out


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """SGLang's / DFlash's default capture layers: evenly spaced over [1, T-3]; [T//2] for one layer."""
    if num_target_layers <= 0 or num_draft_layers <= 0:
        raise ContractError(
            "bad_config",
            f"cannot pick default target layers for {num_target_layers} target and "
            f"{num_draft_layers} draft layers: both must be positive",
        )
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ContractError(
            "bad_config",
            f"default target layer ids need a target with >= 4 layers, got {num_target_layers}; "
            "set dflash_config.target_layer_ids in the drafter's config.json",
        )
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


# --------------------------------------------------------------------------------------------
# The configs' fields (model_files reads the files; these say what the numbers must be)


def _shown(values: list[Any], limit: int = 8) -> str:
    """A list for an error message, cut short: a hostile config may list a million ids."""
    if len(values) <= limit:
        return str(values)
    return "[" + ", ".join(str(v) for v in values[:limit]) + f", ... ({len(values)} in all)]"


def _int_field(path: Path, value: Any, name: str, *, minimum: int = 1, required: bool = True) -> int | None:
    if value is None:
        if required:
            raise ContractError("bad_config", f"{path} has no {name}")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_COUNT:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
        raise ContractError(
            "bad_config", f"{path}: {name} must be an integer in {minimum}..{MAX_COUNT}, got {shown}"
        )
    return value


def _is_hybrid(config: dict[str, Any], text: dict[str, Any]) -> bool:
    for cfg in (config, text):
        model_type = str(cfg.get("model_type", "")).lower()
        if any(model_type.startswith(t) for t in _HYBRID_MODEL_TYPES):
            return True
        layer_types = cfg.get("layer_types")
        if isinstance(layer_types, list) and any(str(t).lower() in _HYBRID_LAYER_TYPES for t in layer_types):
            return True
        if cfg.get("full_attention_interval") is not None or cfg.get("mamba_d_state") is not None:
            return True
        archs = cfg.get("architectures") or []
        if isinstance(archs, list) and any(
            any(h in str(a).lower() for h in ("mamba", "qwen3_5", "qwen3next", "qwen3_next", "jamba"))
            for a in archs
        ):
            return True
    return False


# --------------------------------------------------------------------------------------------
# The contract


def load_contract(target_dir: str | Path, draft_dir: str | Path, *, check: bool = True) -> HiddenContract:
    """Read both models' files and state the hidden-state contract.

    With ``check`` (the default) the expected capture width must equal the drafter's ``fc``
    input width, else :class:`ContractError` ``fc_width_mismatch``; ``check=False`` returns the
    contract anyway (probes report the numbers themselves).
    """
    target_dir, draft_dir = Path(target_dir), Path(draft_dir)
    target_cfg = read_config(target_dir, "target")
    tpath = target_dir / "config.json"
    text = target_cfg.get("text_config")
    text = text if isinstance(text, dict) else target_cfg  # Qwen3.5/3.6 nest the LM config
    hidden = _int_field(tpath, text.get("hidden_size", target_cfg.get("hidden_size")), "hidden_size")
    layers = _int_field(
        tpath, text.get("num_hidden_layers", target_cfg.get("num_hidden_layers")), "num_hidden_layers"
    )
    assert hidden is not None and layers is not None

    draft_cfg = read_config(draft_dir, "draft")
    dpath = draft_dir / "config.json"
    dflash = draft_cfg.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise ContractError("bad_config", f"{dpath}: dflash_config must be a JSON object")

    def pick(name: str) -> Any:
        return dflash.get(name, draft_cfg.get(name))

    draft_hidden = _int_field(dpath, draft_cfg.get("hidden_size"), "hidden_size")
    draft_layers = _int_field(dpath, draft_cfg.get("num_hidden_layers"), "num_hidden_layers", required=False)
    block_size = _int_field(dpath, pick("block_size"), "block_size (dflash_config or top level)", minimum=2)
    mask_token_id = _int_field(dpath, pick("mask_token_id"), "mask_token_id", minimum=0, required=False)
    declared_target_layers = _int_field(dpath, pick("num_target_layers"), "num_target_layers", required=False)
    assert draft_hidden is not None and block_size is not None

    warnings: list[str] = []
    ids_raw = pick("target_layer_ids")
    if ids_raw is None:
        if draft_layers is None:
            raise ContractError(
                "bad_config",
                f"{dpath} has neither dflash_config.target_layer_ids nor num_hidden_layers: "
                "cannot tell which target layers to capture",
            )
        ids = build_target_layer_ids(layers, draft_layers)
        warnings.append(f"no target_layer_ids in {dpath}; using SGLang's default {ids}")
    else:
        if not (
            isinstance(ids_raw, list)
            and ids_raw
            and all(isinstance(i, int) and not isinstance(i, bool) for i in ids_raw)
        ):
            raise ContractError(
                "bad_config",
                f"{dpath}: target_layer_ids must be a non-empty list of integers, got {ids_raw!r}",
            )
        ids = [int(i) for i in ids_raw]
    bad = [i for i in ids if not 0 <= i < layers]
    if bad:
        raise ContractError(
            "layer_ids_out_of_range",
            f"drafter captures target layers {_shown(ids)} but the target ({tpath}) has {layers} layers "
            f"(valid ids 0..{layers - 1}); out of range: {_shown(bad)}. "
            "Is this drafter made for this target?",
            target_layer_ids=ids[:64],
            target_num_layers=layers,
        )
    _check_capture_order(ids, hidden, dpath)
    if declared_target_layers is not None and declared_target_layers != layers:
        warnings.append(
            f"drafter was made for a {declared_target_layers}-layer target, this target has {layers} layers"
        )

    (fc_out, fc_in), fc_file = find_fc_weight(draft_dir)
    if fc_out != draft_hidden:
        raise ContractError(
            "fc_width_mismatch",
            f"drafter fc.weight in {fc_file} is [{fc_out}, {fc_in}] but its config says hidden_size "
            f"{draft_hidden}: the checkpoint and its config.json do not belong together",
            fc_out_features=fc_out,
            draft_hidden_size=draft_hidden,
        )
    contract = HiddenContract(
        target_hidden_size=hidden,
        target_num_layers=layers,
        target_layer_ids=tuple(ids),
        block_size=block_size,
        draft_hidden_size=draft_hidden,
        fc_in_features=fc_in,
        mask_token_id=mask_token_id,
        hybrid=_is_hybrid(target_cfg, text),
        warnings=tuple(warnings),
    )
    if check and contract.capture_width != fc_in:
        raise ContractError(
            "fc_width_mismatch",
            f"drafter fc expects [N, {fc_in}] but the target captures [N, {contract.capture_width}] "
            f"({len(ids)} target layers x {hidden}){_width_hint(fc_in, hidden, len(ids))}",
            expected=fc_in,
            capture_width=contract.capture_width,
        )
    return contract


def _check_capture_order(ids: list[int], hidden: int, dpath: Path) -> None:
    """SGLang 0.5.23 captures "before layer id+1" while it runs the layers in order, once per layer
    (``if i in layers_to_capture``): a repeated id is captured once, and the concatenation follows the
    layer order, whatever order the drafter's config lists. Both break the drafter at run time."""
    distinct = sorted(set(ids))
    if len(distinct) != len(ids):
        repeated = sorted({i for i in ids if ids.count(i) > 1}) if len(ids) <= 4096 else "several"
        raise ContractError(
            "layer_ids_repeated",
            f"{dpath}: target_layer_ids {_shown(ids)} repeat layer(s) {repeated}; SGLang captures each layer "
            f"once, so the target hands the drafter [N, {len(distinct) * hidden}] ({len(distinct)} layers x "
            f"{hidden}) where it expects [N, {len(ids) * hidden}]: a hidden width mismatch at run time",
            expected=len(ids) * hidden,
            capture_width=len(distinct) * hidden,
        )
    if ids != distinct:
        raise ContractError(
            "layer_ids_unsorted",
            f"{dpath}: target_layer_ids {_shown(ids)} are not in ascending order; SGLang captures the target "
            f"layers in layer order ({_shown(distinct)}), so the drafter would get the right width with its "
            "slices swapped (silently wrong drafts). List the ids in ascending order only if the drafter was "
            "trained that way; otherwise this drafter cannot be served by SGLang as is",
            target_layer_ids=ids[:64],
        )


def _width_hint(fc_in: int, hidden: int, n_ids: int) -> str:
    if fc_in % hidden == 0:
        return (
            f": the drafter was trained on {fc_in // hidden} layers of a {hidden}-wide target but its "
            f"config lists {n_ids} target_layer_ids"
        )
    return (
        f": {fc_in} is not a multiple of the target's hidden size {hidden}; "
        "is this drafter made for this target?"
    )
