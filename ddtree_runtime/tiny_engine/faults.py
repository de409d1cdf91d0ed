"""Lab faults (docs/interfaces.md section 3) and the way a failing server dies: SGLang's way.

Each fault reproduces a failure seen in the field, or one a probe must catch:

- ``capture_predicate``: the target captures one layer, so the drafter is handed [N, H] instead of
  [N, k*H] (a DFlash-family predicate that does not include DDTREE);
- ``hidden_none``: the target captures nothing (hidden states None);
- ``relaxed_accept``: the greedy walk accepts a drafted token whose target probability is at least 0.1,
  the target's first choice or not (a relaxed acceptance threshold, like SGLang's
  --speculative-accept-threshold-single, applied at T = 0): fluent text and an acceptance length in the
  usual range, but not the target's greedy output (the live probe's lossless check names it);
- ``slow_start``: model loading takes ``DDTREE_LAB_START_DELAY_S`` seconds (default 30);
- ``crash_after_start``: the scheduler dies ``DDTREE_LAB_CRASH_AFTER_S`` seconds after ready (default 5).

The start-up memory failure is no switch: it comes from --mem-fraction-static and --context-length
(see server_args.memory_plan).

SGLang's scheduler logs "Scheduler hit an exception: <traceback>", signals its parent, which logs
"Received sigquit from a child process. It usually means the child failed." and SIGKILLs its process
tree including itself, so systemd sees code=killed, status=9 (exit 137 from a shell).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import traceback
from dataclasses import dataclass

import torch
from torch import Tensor

from ddtree_runtime.core.tree import DraftTree, WalkResult, walk_posterior

ENGINE_FAULTS = ("capture_predicate", "hidden_none", "relaxed_accept")
RELAXED_THRESHOLD = 0.1  # relaxed_accept: the target probability a drafted token needs
FAULTS = (*ENGINE_FAULTS, "slow_start", "crash_after_start")

log = logging.getLogger("ddtree.lab")


@dataclass(frozen=True)
class FaultPlan:
    fault: str | None
    start_delay_s: float = 0.0
    crash_after_s: float = 5.0

    @property
    def engine_fault(self) -> str | None:
        return self.fault if self.fault in ENGINE_FAULTS else None


def fault_plan(flag: str | None, env: dict[str, str] | None = None) -> FaultPlan:
    """The fault from --lab-fault or DDTREE_LAB_FAULT (flag wins); ValueError names the known ones."""
    env = dict(os.environ if env is None else env)
    fault = flag or env.get("DDTREE_LAB_FAULT") or None
    if fault is not None and fault not in FAULTS:
        raise ValueError(
            f"unknown lab fault {fault!r} (DDTREE_LAB_FAULT / --lab-fault); known: {', '.join(FAULTS)}"
        )
    delay = _seconds(env, "DDTREE_LAB_START_DELAY_S", 30.0) if fault == "slow_start" else 0.0
    crash = _seconds(env, "DDTREE_LAB_CRASH_AFTER_S", 5.0)
    return FaultPlan(fault, delay, crash)


def _seconds(env: dict[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from exc
    if value < 0:
        raise ValueError(f"{name}={raw!r} must be >= 0")
    return value


def relaxed_greedy_walk(tree: DraftTree, target_logits: Tensor, threshold: float = RELAXED_THRESHOLD
                        ) -> WalkResult:
    """relaxed_accept: the greedy walk over ``target_logits [b, B+1, V]``, except that at every node the
    first drafted child (in pop order) whose target probability is at least ``threshold`` is accepted,
    the target's first choice or not."""
    probs = torch.softmax(target_logits.float(), dim=-1)
    b, rows, _ = probs.shape
    parents = tree.parents[:, 1:].clamp(min=0)  # [b, B]: the parent of node i+1
    child = tree.tokens.clamp(min=0)
    p_child = probs.gather(1, parents[:, :, None].expand(-1, -1, probs.shape[-1])).gather(
        2, child[:, :, None])[:, :, 0]
    ok = (tree.depths > 0) & (p_child >= threshold)
    nodes = torch.arange(1, rows, device=child.device).expand(b, -1)
    none = torch.full((b, rows), rows, dtype=torch.long, device=child.device)
    first = none.scatter_reduce(1, parents, torch.where(ok, nodes, rows), "amin")  # [b, B+1]
    tokens = torch.cat([child, child[:, :1]], dim=1)  # node j's token at j - 1; the pad is never read
    decided = torch.where(first < rows, tokens.gather(1, (first - 1).clamp(min=0)), target_logits.argmax(-1))
    return walk_posterior(tree, decided)


def die_like_sglang(exc: BaseException, *, where: str = "Scheduler") -> None:
    """Log the exception the way SGLang's scheduler does, then SIGKILL this process (never returns)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    log.error("%s hit an exception: %s", where, tb.rstrip())
    log.error("Received sigquit from a child process. It usually means the child failed.")
    for handler in logging.getLogger().handlers + log.handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def arm_crash_after_start(seconds: float) -> threading.Timer:
    """crash_after_start: the scheduler dies a while after 'ready', as a runtime crash in the field does."""

    def crash() -> None:
        try:
            raise RuntimeError(
                f"lab fault crash_after_start: the scheduler crashed {seconds:g}s after start "
                "(DDTREE_LAB_FAULT=crash_after_start)"
            )
        except RuntimeError as exc:
            die_like_sglang(exc)

    timer = threading.Timer(seconds, crash)
    timer.daemon = True
    timer.start()
    return timer
