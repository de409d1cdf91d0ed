"""Compile the round's Triton kernels for sm_90 on a machine without a GPU (catches compile errors).

The interpreter (TRITON_INTERPRET=1) runs the kernels' logic on the CPU but accepts code that
the compiler refuses (a loop variable that changes shape, say); this script runs the real
compiler, down to a cubin with the ptxas that ships with Triton, for the shapes the bench uses.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from ddtree_runtime.core.kernels import build, gdn_tree_recurrent, topk, walk

TARGET = GPUTarget("cuda", 90, 32)


def _sig(fn, types: dict[str, str], consts: dict[str, object]) -> tuple[dict, dict]:
    sig = {}
    for name in fn.arg_names:
        sig[name] = "constexpr" if name in consts else types.get(name, "i32")
    return sig, {(fn.arg_names.index(k),): v for k, v in consts.items()}


CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _resources(cubin: bytes) -> dict[str, int]:
    """Registers and stack bytes per thread, from cuobjdump (the ptxas of this Triton wheel)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return {"regs": int(found[1]), "stack": int(found[2])} if found else {}


def check(fn, types: dict[str, str], consts: dict[str, object], num_warps: int) -> None:
    sig, constexprs = _sig(fn, types, consts)
    src = ASTSource(fn, sig, constexprs)
    compiled = compile(src, target=TARGET, options={"num_warps": num_warps})
    use = _resources(compiled.asm["cubin"]) if os.path.exists(CUOBJDUMP) else {}
    print(f"ok {fn.__name__} {json.dumps({'constexprs': consts, 'num_warps': num_warps, **use})}", flush=True)


def main() -> int:
    p64, pf, pi32 = "*i64", "*fp32", "*i32"
    # The sizes the bench's rounds launch (b1 B64, b32 B64, b1 B1024), planned by topk itself.
    for rows, k in [(15, 64), (480, 64), (15, 1024)]:
        cfg = topk.config(rows, 248320, k)
        check(
            topk._chunk_kernel,
            {
                "x_ptr": "*bf16",
                "scratch_ptr": p64,
                "count_ptr": pi32,
                "bound_ptr": p64,
                "max_ptr": pf,
                "sum_ptr": pf,
            },
            cfg.chunk_constexprs(),
            cfg.warps,
        )
        if cfg.exact:
            check(
                topk._exact_kernel,
                {"scratch_ptr": p64, "count_ptr": pi32, "bound_ptr": p64},
                {"KC": cfg.kc, "CAP": cfg.cap, "EXN": cfg.exact},
                4,
            )
        check(
            topk._gather_kernel,
            {
                "scratch_ptr": p64,
                "count_ptr": pi32,
                "bound_ptr": p64,
                "max_ptr": pf,
                "sum_ptr": pf,
                "cand_ptr": p64,
                "ncand_ptr": pi32,
                "lse_ptr": pf,
            },
            {**cfg.gather_constexprs(), "PRECISE_LOG": True},
            4,
        )
    # A TP 2 shard's fp32 logits at batch 16 and the largest K (tp_head's shard-local top-K).
    shard = topk.config(240, 124160, 1023)
    check(
        topk._chunk_kernel,
        {"x_ptr": pf, "scratch_ptr": p64, "count_ptr": pi32, "bound_ptr": p64, "max_ptr": pf, "sum_ptr": pf},
        shard.chunk_constexprs(),
        shard.warps,
    )
    for raw in (False, True):  # log-probs (the tree's top-K) and logits (a shard's top-K)
        check(
            topk._rank_kernel,
            {"cand_ptr": p64, "ncand_ptr": pi32, "lse_ptr": pf, "lp_ptr": pf, "ids_ptr": p64},
            {"BI": 64, "BJ": 128, "RAW": raw},
            4,
        )
    wtypes = {
        n: p64
        for n in (
            "tokens_ptr",
            "parents_ptr",
            "pidx_ptr",
            "cur_ptr",
            "post_ptr",
            "acc_ptr",
            "num_ptr",
            "bonus_ptr",
            "emit_ptr",
            "num_emit_ptr",
        )
    }
    wtypes |= {"x_ptr": "*bf16", "pmax_ptr": pf}
    for last in (False, True):
        check(walk._lazy_step_kernel, wtypes, {"BP": 64, "LP": 16, "NCP": 64, "TILE": 4096, "LAST": last}, 4)
    btypes = {n: p64 for n in ("ids_ptr", "tokens_ptr", "depths_ptr", "parents_ptr", "ranks_ptr")}
    btypes |= {"lp_ptr": pf, "scores_ptr": pf}
    check(build._build_kernel, btypes, {"F": 64, "BP": 64}, 1)
    # The GDN tree verify at Qwen3.6-27B's heads (48 value, 16 query/key, dim 128), the launch SGLang picks
    # on sm_90 (BV 4, one warp), fp32 and bf16 scratch, with and without the parent reuse.
    pbf = "*bf16"
    for scratch in (pf, pbf):
        gtypes = {
            "A_log": pf, "a": pbf, "dt_bias": pf, "softplus_beta": "fp32", "softplus_threshold": "fp32",
            "q": pbf, "k": pbf, "v": pbf, "b": pbf, "o": pbf, "h0_source": scratch, "h0_indices": pi32,
            "stride_h0_source": "i64", "cu_seqlens": pi32, "intermediate_states_buffer": scratch,
            "intermediate_state_indices": pi32, "retrieve_parent_token_ptr": pi32, "scale": "fp32",
        }  # fmt: skip
        for reuse in (False, True):
            gconsts = {
                "stride_retrieve_parent_token_seq": 16, "stride_retrieve_parent_token_token": 1, "NP2_T": 16,
                "H": 16, "HV": 48, "K": 128, "V": 128, "BK": 128, "BV": 4, "USE_QK_L2NORM_IN_KERNEL": True,
                "SPLIT_N_HV_GRID": True, "REUSE_PARENT": reuse, "USE_GDC": True,
            }  # fmt: skip
            check(gdn_tree_recurrent._gdn_tree_verify_kernel, gtypes, gconsts, 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
