"""A CPU stand-in for device memory whose values the host may not read.

SGLang's overlap scheduler needs the worker's forward to read nothing back from the GPU; on CUDA
``torch.cuda.set_sync_debug_mode("error")`` catches a read (tests/gpu). Here there is no device, so
``DeviceTensor`` marks the tensors that would live on it: every op on one gives another (torch's
subclass propagation), and each operation that would make the host wait for a CUDA device raises
``HostRead``: reading a value (``item``, ``tolist``, ``bool``/``int``/``float``/``index``), sizing
an output by the data (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``,
``repeat_interleave`` by a tensor) or the ops whose CUDA code checks its input on the host
(``multinomial``). Host tensors (SGLang's ``seq_lens_cpu``, ``nxt_kv_lens_cpu``) stay plain.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import torch

_READS = frozenset(
    {
        "item",
        "tolist",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "__array__",
        "numpy",
        "cpu",
        "nonzero",
        "argwhere",
        "masked_select",
        "unique",
        "unique_consecutive",
        "multinomial",
        "equal",
        "allclose",
    }
)


class HostRead(AssertionError):
    """The code under test read a device value on the host (a sync under CUDA)."""


def _bool_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class DeviceTensor(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _READS:
            raise HostRead(f"{name}() on a device tensor")
        if name in ("__getitem__", "__setitem__") and len(args) > 1 and _bool_index(args[1]):
            raise HostRead(f"boolean-mask {name} on a device tensor (its size is data-dependent)")
        if name == "repeat_interleave":
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
                raise HostRead("repeat_interleave by a tensor without output_size")
        return super().__torch_function__(func, types, args, kwargs)


def on_device(t: torch.Tensor) -> DeviceTensor:
    """The same storage, marked as device memory."""
    return t.as_subclass(DeviceTensor)


def on_host(x: Any) -> Any:
    """Unmark (tensors, tuples, lists, dataclasses, namespaces): for the fakes that stand in for the
    model runners, which are outside what the test guards."""
    if isinstance(x, DeviceTensor):
        return x.as_subclass(torch.Tensor)
    if isinstance(x, tuple):
        return tuple(on_host(i) for i in x)
    if isinstance(x, list):
        return [on_host(i) for i in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return SimpleNamespace(**{f.name: on_host(getattr(x, f.name)) for f in dataclasses.fields(x)})
    return x


def to_device(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and not isinstance(x, DeviceTensor):
        return on_device(x)
    if isinstance(x, tuple):
        return tuple(to_device(i) for i in x)
    return x


class GuardedModels:
    """``tree_round.RoundModels`` around a fake: its inputs unmarked, its outputs marked as device
    tensors (what SGLang's runners hand back on a GPU). Records the order of the calls."""

    def __init__(self, models: Any, calls: list[str]) -> None:
        self.models = models
        self.calls = calls

    def draft_block(self, *args: Any) -> Any:
        self.calls.append("draft_block")
        return to_device(self.models.draft_block(*on_host(args)))

    def draft_hidden(self, *args: Any) -> Any:
        self.calls.append("draft_hidden")
        return to_device(self.models.draft_hidden(*on_host(args)))

    def target_verify(self, plan: Any, cache_loc: Any, req_pool_indices: Any) -> Any:
        self.calls.append("target_verify")
        out = self.models.target_verify(on_host(plan), on_host(cache_loc), on_host(req_pool_indices))
        return to_device(out)

    def append_draft_context(self, *args: Any) -> None:
        self.calls.append("append_draft_context")
        self.models.append_draft_context(*on_host(args))
