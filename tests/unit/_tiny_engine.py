"""Shared by the tiny engine's tests: lab models (made once, cached by source hash), server processes."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import ddtree_runtime.tiny_engine as lab_pkg
from ddtree_runtime.tiny_engine.ports import PortLease, lease_ports

_SOURCES = ("make.py", "model_config.py", "models.py", "kv_cache.py", "gdn.py", "language.py", "tokenizer.py",
            "hf_tokenizer.py")


@cache
def lab_models(kind: str = "dense") -> Path:
    """DIR with target/, draft/, draft-mismatched/ of the dense or the hybrid pair; rebuilt only when
    the model-making code changes."""
    digest = hashlib.sha256()
    for name in _SOURCES:
        digest.update((Path(lab_pkg.__file__).parent / name).read_bytes())
    suffix = "" if kind == "dense" else f"-{kind}"
    root = Path(tempfile.gettempdir()) / f"ddtree-lab-models-{os.getuid()}-{digest.hexdigest()[:16]}{suffix}"
    stamp = root / "done.json"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp.exists():
            from ddtree_runtime.tiny_engine.make import make_models

            summary = make_models(root, kind=kind, log=lambda _msg: None)
            stamp.write_text(json.dumps(summary))
    return root


def contrary_drafter(models: Path, out: Path) -> Path:
    """The lab drafter with its final norm negated: its logits are the negation of what it learnt, so it
    proposes the tokens it finds least likely and the target accepts almost none (acceptance ~1). Same
    config and widths: the handshake still agrees."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(models / "draft", out, dirs_exist_ok=True)
    weights = load_file(str(out / "model.safetensors"))
    weights["norm.weight"] = -weights["norm.weight"]
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def first_round_emits(engine, states: list[list[int]]) -> list[int]:
    """Tokens each state's first verify round emits (accepted drafts + the bonus token), as one batch.

    Acceptance compared over whole generations is luck: engines whose rounds end at other tokens go on
    from other states. From one state, what each engine's tree can accept is fixed by construction
    (a budget-64 tree holds the budget-16 tree; every tree holds the chain's first draft).
    """
    from ddtree_runtime.tiny_engine.engine import SamplingParams

    # max_new_tokens 2: the prefill's token, then exactly one verify round (never cut by EOS).
    res = engine.generate(states, [SamplingParams(max_new_tokens=2, ignore_eos=True)] * len(states))
    return [r.accept_lengths[0] for r in res]


def check_greedy_equals_ar(greedy: dict, name: str, new: int) -> None:
    """The ``greedy`` fixture's outputs of engine ``name``: ``new`` tokens each, the same as AR's."""
    spec, _ = greedy[name]
    assert all(len(o) == new for o in spec)
    assert spec == greedy["AR"][0]


def check_trees_against_the_chain(engines: dict, ar_outputs: list[list[int]], new: int) -> None:
    """Bigger trees accept at least as much as smaller ones, and a tree as much as the chain, compared where
    that is certain: one round from the same states (every sixth prefix of each prompt's greedy output;
    ``engines`` as the ``engines`` fixture names them)."""
    from ddtree_runtime.tiny_engine.language import LAB_PROMPTS

    enc = engines["AR"].tokenizer.encode
    states = [enc(p) + out[:k] for p, out in zip(LAB_PROMPTS, ar_outputs, strict=True)
              for k in range(0, new, 6)]  # fmt: skip
    chain, t16, t64 = (first_round_emits(engines[n], states) for n in ("DFLASH", "DDTREE16", "DDTREE64"))
    assert all(1 <= n <= 16 for n in chain + t16 + t64)
    assert all(b >= a for a, b in zip(t16, t64, strict=True)), (t16, t64)
    assert all(t >= 2 for c, t in zip(chain, t16, strict=True) if c >= 2), (chain, t16)


@contextmanager
def one_thread() -> Iterator[None]:
    """The lab models are tiny: one torch thread is faster, and on a shared CPU much faster."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# Ports handed out by free_port(), held until this process ends (ddtree_runtime.tiny_engine.ports).
_HELD: list[PortLease] = []


def free_port() -> int:
    """A port for a server this test starts: free now and held against every other lease of this
    host's test processes until this one ends (a bind(0) port is free only until someone binds it)."""
    _HELD.append(lease_ports(1))
    return _HELD[-1].ports[0]


def http(url: str, payload: dict | bytes | None = None, *, timeout: float = 60) -> tuple[int, bytes]:
    """(status, body) of a GET, or a POST when payload is given; HTTP errors are returned, not raised."""
    data = payload if isinstance(payload, bytes) or payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
