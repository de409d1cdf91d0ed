"""Process-wide test set-up, for every test directory."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("torch") is not None:
    # The fleet tests load Ansible's inventory API in-process, and Ansible replaces sys.intern
    # with a callable object. torch._dynamo, imported later through SGLang/transformers, then
    # refuses to register its polyfill for it (TypeError: substitute_in_graph expects a function).
    # Importing dynamo first, while sys.intern is still the builtin, keeps both working. Its
    # import pulls torchvision where installed; the sglang environment's CPU workaround comes first.
    if importlib.util.find_spec("torchvision") is not None:
        from tests.sglang._cpu_env import define_torchvision_op_schemas

        define_torchvision_op_schemas()
    import torch._dynamo  # noqa: F401
