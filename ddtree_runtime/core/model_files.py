"""Safe readers of a model directory's files: ``config.json``, the safetensors index and headers.

No tensor data is read: a checkpoint is described from its headers (names, dtypes, shapes). Every
reader is defended against hostile input (regular files only, sizes capped, UTF-8, bounded nesting),
and every failure is one :class:`ContractError` whose message names the file and the likely cause.

This file imports the standard library only, nothing of ours: the deploy sends it alone to a host that
has the model files but no runtime installed yet (``roles/sglang_service/tasks/fit.yml``, Ansible's
script module) and runs ``python3 model_files.py describe TARGET DRAFT`` there (:func:`main`).
``tests/unit/test_import_graph.py`` fails if it imports anything else.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
from pathlib import Path
from typing import Any

__all__ = [
    "ContractError",
    "describe_model_files",
    "find_fc_weight",
    "read_checkpoint_tensors",
    "read_config",
    "read_json_file",
    "read_safetensors_header",
]

# A real header is a few hundred KB even for sharded 27B checkpoints; anything near this is garbage.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# config.json and the shard index are a few KB to a few hundred KB; a larger one is not a model's.
MAX_JSON_BYTES = 16 * 1024 * 1024
_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8,
}  # fmt: skip


class ContractError(ValueError):
    """The target/drafter pair or a live hidden tensor breaks the handshake.

    ``cause`` is a short id: ``hidden_width_mismatch``, ``hidden_states_missing``,
    ``hidden_dtype_mismatch``, ``hidden_device_mismatch``, ``fc_width_mismatch``, ``bad_config``,
    ``bad_safetensors``, ``layer_ids_out_of_range``, ``layer_ids_repeated`` (SGLang captures each
    layer once, so the drafter gets fewer layers than it lists), ``layer_ids_unsorted`` (SGLang
    captures in layer order, not in the listed order). ``details`` holds the numbers involved.
    Defined here, where the readers raise it, so that this file stands alone on a host.
    """

    def __init__(self, cause: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.cause = cause
        self.details = details


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


def _index_weight_map(index: Path) -> dict[str, Any]:
    """A sharded checkpoint's ``weight_map`` (tensor name -> shard file), or ContractError."""
    try:
        doc = read_json_file(index, "safetensors index", cause="bad_safetensors")
    except ContractError as exc:
        raise ContractError("bad_safetensors", f"{index} is not a valid safetensors index: {exc}") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise ContractError("bad_safetensors", f"{index} has no weight_map")
    return weight_map


def _is_shard_name(name: Any) -> bool:
    # A shard is a file next to the index: no paths, so a hostile index cannot point elsewhere.
    if not isinstance(name, str) or name in ("", ".", ".."):
        return False
    return "/" not in name and "\\" not in name


def find_fc_weight(draft_dir: Path) -> tuple[tuple[int, int], Path]:
    """The drafter's ``fc.weight`` [out, in] from a single-file or sharded checkpoint."""
    index = draft_dir / "model.safetensors.index.json"
    if os.path.lexists(index):
        weight_map = _index_weight_map(index)
        key = _fc_key(weight_map, index)
        name = weight_map[key]
        if not _is_shard_name(name):
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
        weight_map = _index_weight_map(index)
        if not weight_map:
            raise ContractError("bad_safetensors", f"{index} has no weight_map")
        names = sorted({v for v in weight_map.values() if isinstance(v, str)})
        bad = [v for v in weight_map.values() if not _is_shard_name(v)]
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
# The describe script (run alone on a host)


def main(argv: list[str] | None = None) -> int:
    """``python3 model_files.py describe TARGET_DIR DRAFT_DIR``: both directories as one JSON document.

    This file imports only the standard library, so a deploy can send it to a host that has the model
    files but no runtime installed yet (Ansible's script module) and plan from what it prints: the
    same readers on the host as on the controller.
    """
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "describe":
        print("usage: model_files.py describe TARGET_DIR DRAFT_DIR", file=sys.stderr)
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
