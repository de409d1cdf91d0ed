"""The memory planner: will a profile fit a host's GPUs, term by term, before anything restarts.

It follows SGLang 0.5.23's own start-up accounting (the functions are cited where each term is
computed) on what the static probe reads: the two ``config.json`` files and the safetensors
headers (``ddtree_runtime.core.model_files``' readers; no tensor is loaded), the GPU facts (nvidia-smi or
the inventory) and the profile's flags. Host side and stdlib only, so the same code plans on a GPU
host, on the controller during a deploy's preflight and in CI.

Modules, one job each: ``shapes`` (model files -> the shapes SGLang sizes from), ``gpus`` (GPU
facts), ``settings`` (profile flags -> SGLang's resolved settings), ``accounting`` (the per-GPU
terms and the verdict), ``fixes`` (the smallest changes that fit), ``report`` (table and JSON),
``cli`` (``ddtree plan``); ``tune`` (``ddtree tune``'s round-cost model and pick), ``tune_fit`` (whether a
setting ``ddtree tune`` may propose fits the host, as ``ddtree plan`` decides) and ``profile_choice``
(which decoder each shipped profile's figures choose, docs/bench/profile-choice.md).
"""

from ddtree_runtime.planner.accounting import Plan, PlanError, plan_memory
from ddtree_runtime.planner.fixes import Change, propose_changes
from ddtree_runtime.planner.gpus import GpuFacts
from ddtree_runtime.planner.settings import ServeSettings
from ddtree_runtime.planner.shapes import ModelPair, load_model_pair

__all__ = [
    "Change",
    "GpuFacts",
    "ModelPair",
    "Plan",
    "PlanError",
    "ServeSettings",
    "load_model_pair",
    "plan_memory",
    "propose_changes",
]
