"""A queued generation job: what the HTTP handlers hand the lab server's scheduler, and get back."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class Job:
    prompts: list[list[int]]
    params: list  # SamplingParams
    logprobs: list | None = None  # LogprobRequest or None per prompt (return_logprob)
    done: threading.Event = field(default_factory=threading.Event)
    results: list | None = None
    remaining: int = 0  # requests of this job still decoding
    created: float = field(default_factory=time.monotonic)
