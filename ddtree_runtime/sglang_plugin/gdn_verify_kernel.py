"""The GDN layers' tree verify on the plugin's recurrence (``core/kernels/gdn_tree_recurrent.py``):
a row whose parent is the previous row keeps the state in registers instead of reloading it from
the per-row scratch. Bit-identical to SGLang's kernel (the tests compare them).

Behind ``SGLANG_DDTREE_GDN_REUSE_PARENT=1``, off by default: it landed in a session without a device,
so neither the whole GPU suite nor its speed at Qwen3.6-27B's shape has run it
(``scripts/kernels/gdn_tree_price.py --configs tree15,tree15-reuse`` measures the kernel alone).
With the switch off nothing is registered and SGLang's kernel runs as before.
"""

from __future__ import annotations

import os
from typing import Any

SWITCH = "SGLANG_DDTREE_GDN_REUSE_PARENT"
TARGET_VERIFY = "sglang.srt.layers.attention.linear.kernels.gdn_triton.TritonGDNKernel.target_verify"


def reuse_parent_on() -> bool:
    return os.environ.get(SWITCH, "0") == "1"


def gdn_target_verify_hook(original: Any, kernel: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``TritonGDNKernel.target_verify`` (``gdn_triton.py`` ~217; its caller passes every
    argument by name): a tree verify (parents given) on CUDA goes to the plugin's recurrence,
    everything else (chains, the CPU) to SGLang's."""
    q = kwargs.get("q")
    if args or kwargs.get("retrieve_parent_token") is None or q is None or q.device.type != "cuda":
        return original(kernel, *args, **kwargs)
    return plugin_target_verify(**kwargs)


def plugin_target_verify(**kwargs: Any) -> Any:
    """``TritonGDNKernel.target_verify``'s tree call on the plugin's recurrence, with the launch
    configuration SGLang's kernel would pick for it."""
    from sglang.kernels.jit.utils import is_arch_support_pdl
    from sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent import (
        _select_recurrent_launch_config,
    )

    from ddtree_runtime.core.kernels.gdn_tree_recurrent import gdn_tree_verify

    q, k, v = kwargs["q"], kwargs["k"], kwargs["v"]
    requests = len(kwargs["query_start_loc"]) - 1
    block_v, num_warps = _select_recurrent_launch_config(
        requests, k.shape[2], v.shape[2], k.shape[3], v.shape[3], False, target_verify=True
    )
    return gdn_tree_verify(
        A_log=kwargs["A_log"], a=kwargs["a"], dt_bias=kwargs["dt_bias"], softplus_beta=1.0,
        softplus_threshold=20.0, q=q, k=k, v=v, b=kwargs["b"],
        initial_state_source=kwargs["ssm_states"], initial_state_indices=kwargs["cache_indices"],
        cu_seqlens=kwargs["query_start_loc"], intermediate_states_buffer=kwargs["intermediate_states_buffer"],
        intermediate_state_indices=kwargs["intermediate_state_indices"],
        retrieve_parent_token=kwargs["retrieve_parent_token"],
        block_v=block_v, num_warps=num_warps, use_pdl=is_arch_support_pdl(),
    )  # fmt: skip


def register_gdn_verify_hook() -> bool:
    """Register the hook when the switch is on; True if registered."""
    if not reuse_parent_on():
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET_VERIFY, gdn_target_verify_hook, HookType.AROUND)
    return True
