"""The hidden-state handshake between a target model and its DFlash-family drafter.

The drafter's ``fc`` takes the target's hidden states at ``target_layer_ids`` concatenated on the
last dim: ``[N, len(ids) * H_target]``. This module states that width from the files alone (the
two ``config.json`` files and the drafter's safetensors header, no tensor is loaded) and checks a
live tensor against it. Every failure is one :class:`ContractError` whose message names the
numbers and the likely cause. It imports nothing else of ours and no torch at import time.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ContractError",
    "HiddenContract",
    "build_target_layer_ids",
    "check_hidden_states",
    "describe_model_files",
    "load_contract",
    "read_checkpoint_tensors",
    "read_config",
    "read_safetensors_header",
]

# A real header is a few hundred KB even for sharded 27B checkpoints; anything near this is garbage.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# config.json and the shard index are a few KB to a few hundred KB; a larger one is not a model's.
MAX_JSON_BYTES = 16 * 1024 * 1024
# Model dimensions SGLang indexes with int32: anything larger is a corrupt or hostile config.
MAX_COUNT = 2**31 - 1
_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8,
}  # fmt: skip
_HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_next", "mamba", "jamba", "nemotron_h", "falcon_h1", "zamba", "bamba")
_HYBRID_LAYER_TYPES = ("linear_attention", "mamba", "mamba2", "gated_deltanet", "recurrent")


class ContractError(ValueError):
    """The target/drafter pair or a live hidden tensor breaks the handshake.

    ``cause`` is a short id: ``hidden_width_mismatch``, ``hidden_states_missing``,
    ``hidden_dtype_mismatch``, ``hidden_device_mismatch``, ``fc_width_mismatch``, ``bad_config``,
    ``bad_safetensors``, ``layer_ids_out_of_range``, ``layer_ids_repeated`` (SGLang captures each
    layer once, so the drafter gets fewer layers than it lists), ``layer_ids_unsorted`` (SGLang
    captures in layer order, not in the listed order). ``details`` holds the numbers involved.
    """

    def __init__(self, cause: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.cause = cause
        self.details = details


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
# Files


def _shown(values: list[Any], limit: int = 8) -> str:
    """A list for an error message, cut short: a hostile config may list a million ids."""
    if len(values) <= limit:
        return str(values)
    return "[" + ", ".join(str(v) for v in values[:limit]) + f", ... ({len(values)} in all)]"


def _open_regular(path: Path, what: str, cause: str) -> tuple[int, int]:
    """(fd, size) of a regular file. O_NONBLOCK: a FIFO planted in a model directory must not block the
    open; the fstat then refuses it, as it refuses /dev/zero and other devices."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ContractError(cause, f"{what} {path} is missing", path=str(path)) from None
    except OSError as exc:
        raise ContractError(cause, f"cannot read {what} {path}: {_reason(exc)}", path=str(path)) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise ContractError(
            cause, f"{what} {path} is not a regular file ({_file_kind(info.st_mode)})", path=str(path)
        )
    return fd, info.st_size


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))  # fmt: skip
    for test, name in kinds:
        if test(mode):
            return name
    return "not a file"


def _reason(exc: OSError) -> str:
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied (run as a user that can read the model directories)"
    return exc.strerror or str(exc)


def read_json_file(path: Path, what: str, *, cause: str = "bad_config", limit: int = MAX_JSON_BYTES) -> Any:
    """A small JSON document, defended: regular file only, size-capped, UTF-8, bounded nesting."""
    fd, size = _open_regular(path, what, cause)
    with os.fdopen(fd, "rb") as fh:
        if size > limit:
            raise ContractError(
                cause, f"{what} {path} is {size} bytes (limit {limit}): too large to be one"
            )
        raw = fh.read(limit + 1)
    return _parse_json(raw, f"{what} {path}", cause)


def _parse_json(raw: bytes, where: str, cause: str) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ContractError(
            cause, f"{where} is not valid JSON: not UTF-8 (bad byte at offset {exc.start})"
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ContractError(cause, f"{where} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except RecursionError:
        raise ContractError(cause, f"{where} is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # e.g. an integer literal of more than 4300 digits
        raise ContractError(cause, f"{where} is not valid JSON: {str(exc)[:120]}") from None


def read_config(model_dir: str | Path, role: str) -> dict[str, Any]:
    """A model directory's ``config.json`` as a dict; ``role`` ("target"/"draft") names it in errors."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    try:
        info = model_dir.stat()
    except FileNotFoundError:
        raise ContractError(
            "bad_config", f"{role} model directory {model_dir} does not exist", path=str(path)
        ) from None
    except OSError as exc:
        raise ContractError(
            "bad_config", f"cannot open {role} model directory {model_dir}: {_reason(exc)}"
        ) from None
    if not stat.S_ISDIR(info.st_mode):
        raise ContractError("bad_config", f"{role} model path {model_dir} is not a directory")
    try:
        os.lstat(path)
    except FileNotFoundError:
        raise ContractError(
            "bad_config", f"{role} config {path} is missing: is {model_dir} a Hugging Face model directory?"
        ) from None
    except OSError as exc:  # a directory we may not search
        raise ContractError("bad_config", f"cannot read {role} config {path}: {_reason(exc)}") from None
    data = read_json_file(path, f"{role} config")
    if not isinstance(data, dict):
        raise ContractError("bad_config", f"{role} config {path} must hold a JSON object")
    return data


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


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (8-byte little-endian length, then JSON); no data read.

    The tensor data is never read, so a file holding only a header is accepted: the tests use that
    to state real 27B shapes without writing gigabytes.
    """
    fd, size = _open_regular(path, "drafter weights", "bad_safetensors")
    with os.fdopen(fd, "rb") as fh:
        raw_len = fh.read(8)
        if len(raw_len) < 8:
            raise ContractError(
                "bad_safetensors",
                f"{path} is truncated: {len(raw_len)} bytes, shorter than the 8-byte header length",
            )
        (length,) = struct.unpack("<Q", raw_len)
        if length > MAX_HEADER_BYTES:
            raise ContractError(
                "bad_safetensors",
                f"{path} declares a {length}-byte header (limit {MAX_HEADER_BYTES}): "
                "not a safetensors file, or a corrupt one",
            )
        if length > size - 8:
            raise ContractError(
                "bad_safetensors",
                f"{path} is truncated: header declares {length} bytes, file holds {size - 8}",
            )
        raw = fh.read(length)
    if len(raw) < length:
        raise ContractError(
            "bad_safetensors", f"{path} is truncated: header declares {length} bytes, file holds {len(raw)}"
        )
    header = _parse_json(raw, f"{path}: the safetensors header", "bad_safetensors")
    if not isinstance(header, dict):
        raise ContractError("bad_safetensors", f"{path}: the safetensors header must be a JSON object")
    return header


def _fc_shape_from_file(path: Path, key: str) -> tuple[int, int]:
    header = read_safetensors_header(path)
    entry = header.get(key)
    if not isinstance(entry, dict):
        raise ContractError(
            "bad_safetensors", f"{path} holds no {key}: is this a DFlash drafter checkpoint?", key=key
        )
    shape, dtype, offsets = entry.get("shape"), entry.get("dtype"), entry.get("data_offsets")
    if not (isinstance(shape, list) and len(shape) == 2 and all(_is_count(s) for s in shape)):
        raise ContractError("bad_safetensors", f"{path}: {key} shape must be [out, in], got {shape!r}")
    itemsize = _DTYPE_BYTES.get(str(dtype))
    if itemsize is None:
        raise ContractError("bad_safetensors", f"{path}: {key} has unknown dtype {dtype!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise ContractError("bad_safetensors", f"{path}: {key} data_offsets must be [begin, end]")
    if offsets[1] - offsets[0] != shape[0] * shape[1] * itemsize:
        raise ContractError(
            "bad_safetensors",
            f"{path}: {key} data_offsets {offsets} do not match shape {shape} x {dtype} "
            f"({shape[0] * shape[1] * itemsize} bytes): corrupt header",
        )
    return int(shape[0]), int(shape[1])


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _find_fc_weight(draft_dir: Path) -> tuple[tuple[int, int], Path]:
    """The drafter's ``fc.weight`` [out, in] from a single-file or sharded checkpoint."""
    index = draft_dir / "model.safetensors.index.json"
    if os.path.lexists(index):
        try:
            doc = read_json_file(index, "safetensors index", cause="bad_safetensors")
        except ContractError as exc:
            raise ContractError(
                "bad_safetensors", f"{index} is not a valid safetensors index: {exc}"
            ) from None
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict):
            raise ContractError("bad_safetensors", f"{index} has no weight_map")
        key = _fc_key(weight_map, index)
        name = weight_map[key]
        # A shard is a file next to the index: no paths, so a hostile index cannot point elsewhere.
        if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
            raise ContractError(
                "bad_safetensors", f"{index}: {key} maps to {str(name)[:80]!r}, not a shard file name"
            )
        shard = draft_dir / name
        return _fc_shape_from_file(shard, key), shard
    single = draft_dir / "model.safetensors"
    if not os.path.lexists(single):
        try:
            found = sorted(p.name for p in draft_dir.glob("*.safetensors"))
        except OSError as exc:
            raise ContractError("bad_safetensors", f"cannot list {draft_dir}: {_reason(exc)}") from None
        if len(found) != 1:
            raise ContractError(
                "bad_safetensors",
                f"drafter weights not found in {draft_dir}: expected model.safetensors or "
                f"model.safetensors.index.json (found {found or 'no .safetensors files'})",
            )
        single = draft_dir / found[0]
    key = _fc_key(read_safetensors_header(single), single)
    return _fc_shape_from_file(single, key), single


def _fc_key(names: dict[str, Any], where: Path) -> str:
    if "fc.weight" in names:
        return "fc.weight"
    candidates = [k for k in names if k.endswith(".fc.weight")]
    if len(candidates) == 1:
        return candidates[0]
    raise ContractError(
        "bad_safetensors", f"{where} names no fc.weight tensor: is this a DFlash drafter checkpoint?"
    )


def _weight_files(model_dir: Path, role: str) -> list[Path]:
    """Every safetensors file of a checkpoint: the shards its index names, else the ``*.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if os.path.lexists(index):
        try:
            doc = read_json_file(index, "safetensors index", cause="bad_safetensors")
        except ContractError as exc:
            raise ContractError(
                "bad_safetensors", f"{index} is not a valid safetensors index: {exc}"
            ) from None
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ContractError("bad_safetensors", f"{index} has no weight_map")
        names = sorted({v for v in weight_map.values() if isinstance(v, str)})
        # Shards are files next to the index (as in _find_fc_weight): a hostile index cannot point elsewhere.
        bad = [v for v in weight_map.values() if not isinstance(v, str) or not v or "/" in v or "\\" in v
               or v in (".", "..")]
        if bad:
            raise ContractError(
                "bad_safetensors", f"{index} maps tensors to {str(bad[0])[:80]!r}, not a shard file name"
            )
        return [model_dir / name for name in names]
    try:
        found = sorted(model_dir.glob("*.safetensors"))
    except OSError as exc:
        raise ContractError("bad_safetensors", f"cannot list {model_dir}: {_reason(exc)}") from None
    if not found:
        raise ContractError(
            "bad_safetensors",
            f"{role} weights not found in {model_dir}: "
            "no model.safetensors.index.json and no .safetensors files",
        )
    return found


def read_checkpoint_tensors(model_dir: str | Path, role: str = "target") -> dict[str, dict[str, Any]]:
    """``name -> {"dtype", "shape"}`` for every tensor of a checkpoint, from the headers alone.

    Each entry's ``data_offsets`` must match its shape and dtype (a corrupt header is refused), so a
    caller may size the weights from these entries without reading a byte of tensor data.
    """
    model_dir = Path(model_dir)
    tensors: dict[str, dict[str, Any]] = {}
    for path in _weight_files(model_dir, role):
        for name, entry in read_safetensors_header(path).items():
            if name == "__metadata__":
                continue
            shape = entry.get("shape") if isinstance(entry, dict) else None
            dtype = entry.get("dtype") if isinstance(entry, dict) else None
            offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
            if not (isinstance(shape, list) and all(_is_count(s) for s in shape)):
                raise ContractError("bad_safetensors", f"{path}: {name} has no valid shape ({shape!r})")
            itemsize = _DTYPE_BYTES.get(str(dtype))
            if itemsize is None:
                raise ContractError("bad_safetensors", f"{path}: {name} has unknown dtype {dtype!r}")
            numel = 1
            for s in shape:
                numel *= s
            valid = isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            if not valid or offsets[1] - offsets[0] != numel * itemsize:
                raise ContractError(
                    "bad_safetensors",
                    f"{path}: {name} data_offsets {offsets!r} do not match shape {shape} x {dtype}: "
                    "corrupt header",
                )
            tensors[name] = {"dtype": str(dtype), "shape": [int(s) for s in shape]}
    return tensors


def describe_model_files(model_dir: str | Path, role: str) -> dict[str, Any]:
    """What the memory planner reads of a model directory: its config and its tensor table (JSON-able)."""
    return {"path": str(model_dir), "role": role, "config": read_config(model_dir, role),
            "tensors": read_checkpoint_tensors(model_dir, role)}


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

    (fc_out, fc_in), fc_file = _find_fc_weight(draft_dir)
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


# --------------------------------------------------------------------------------------------
# Live tensors


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _same_device(actual: Any, wanted: Any) -> bool:
    # "cuda" names whichever CUDA device; "cuda:1" names one.
    a, w = str(actual), str(wanted)
    return a == w or (":" not in w and a.split(":")[0] == w)


def check_hidden_states(
    hidden: Any,
    contract: HiddenContract,
    *,
    num_tokens: int | None = None,
    dtype: Any = None,
    device: Any = None,
) -> None:
    """Check a live target hidden tensor ``[N, capture_width]`` before it reaches the drafter."""
    width = contract.capture_width
    layers, h = len(contract.target_layer_ids), contract.target_hidden_size
    if hidden is None:
        raise ContractError(
            "hidden_states_missing",
            f"drafter expects target hidden states [N, {width}] ({layers} target layers x {h}) but got None: "
            "the target did not capture auxiliary hidden states; is the algorithm treated as DFlash-family "
            "(set_dflash_layers_to_capture, capture mode FULL)?",
            expected=width,
        )
    shape = tuple(int(s) for s in getattr(hidden, "shape", ()))
    shown = "[" + ", ".join(str(s) for s in shape) + "]"
    if len(shape) != 2:
        raise ContractError(
            "hidden_width_mismatch",
            f"drafter expects a 2-D tensor [N, {width}] ({layers} target layers x {h}) but got {shown}",
            expected=width,
            observed_shape=list(shape),
        )
    observed = shape[1]
    if observed != width:
        if observed == h:
            why = "the target captured no auxiliary layers; is the algorithm treated as DFlash-family?"
        elif observed % h == 0:
            why = (
                f"the target captured {observed // h} layers instead of {layers}; "
                "do the target_layer_ids given to the target match the drafter's?"
            )
        else:
            why = f"{observed} is not a multiple of the target hidden size {h}; wrong target model?"
        raise ContractError(
            "hidden_width_mismatch",
            f"drafter expects [N, {width}] ({layers} target layers x {h}) but got [N, {observed}]: {why}",
            expected=width,
            observed=observed,
        )
    if num_tokens is not None and shape[0] != num_tokens:
        raise ContractError(
            "hidden_width_mismatch",
            f"expected hidden states for {num_tokens} tokens [{num_tokens}, {width}] but got {shown}: "
            "the capture does not line up with the batch (tree gather index or extend lengths wrong?)",
            expected_tokens=num_tokens,
            observed_tokens=shape[0],
        )
    if dtype is not None and _dtype_name(getattr(hidden, "dtype", None)) != _dtype_name(dtype):
        raise ContractError(
            "hidden_dtype_mismatch",
            f"target hidden states are {_dtype_name(hidden.dtype)} "
            f"but the drafter runs in {_dtype_name(dtype)}",
        )
    if device is not None and not _same_device(getattr(hidden, "device", None), device):
        raise ContractError(
            "hidden_device_mismatch",
            f"target hidden states are on {hidden.device} but the drafter is on {device}",
        )


def main(argv: list[str] | None = None) -> int:
    """``python3 contract.py describe TARGET_DIR DRAFT_DIR``: both directories as one JSON document.

    This file imports only the standard library, so a deploy can send it to a host that has the model
    files but no runtime installed yet (Ansible's script module) and plan from what it prints: the
    same readers on the host as on the controller.
    """
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "describe":
        print("usage: contract.py describe TARGET_DIR DRAFT_DIR", file=sys.stderr)
        return 2
    try:
        doc = {
            "target": describe_model_files(args[1], "target"),
            "draft": describe_model_files(args[2], "draft"),
        }
    except ContractError as exc:
        print(json.dumps({"error": str(exc), "cause": exc.cause}))
        return 1
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
