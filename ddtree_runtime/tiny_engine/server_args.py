"""Launch flags of the lab server: the pinned SGLang release's spelling (0.5.23), and its memory check.

Unknown flags are an argparse error (exit 2), as in SGLang; removed spellings such as
`--cuda-graph-max-bs` fail the same way there ("ambiguous option": two longer flags share the prefix).

Memory model (SGLang's `pool_configurator`): budget = device_total x mem_fraction_static - weights;
max_total_num_tokens = budget / KV bytes per token (bf16 K+V of every target layer, scaled by
(T + D) / T for the DFlash-family draft KV, T target layers, D draft layers). The lab has no real
device memory to divide, so it uses a notional device of DDTREE_LAB_DEVICE_MEMORY_MB (default 128 MiB):
with the lab models the real profiles' settings (0.25 x 8192, 0.40 x 16384, 0.85 x 32768 tokens) fit,
a fraction like 0.02 does not. Like SGLang the server then fails with "Not enough memory. Please try to
increase --mem-fraction-static"; the lab also fails when the pool cannot hold one request of
--context-length tokens, which is what a too-small fraction means on a real host.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from ddtree_runtime.core.decoder_settings import AUTO, DecoderSettings, SettingsError, parse_budget

DEFAULT_DEVICE_MEMORY_MB = 128
DEFAULT_MEM_FRACTION = 0.85  # SGLang picks one from the GPU size when unset
DEFAULT_MAX_RUNNING_DFLASH = 48  # SGLang's DFLASH default when --max-running-requests is unset
# The lab engine's budget when --speculative-ddtree-budget is not given: a fixed 16 whatever the drafter's
# block (the lab's tests and figures are written for it). The SGLang plugin's default is the block - 1 of
# core/decoder_settings.default_budget; every other rule and limit is DecoderSettings' own.
LAB_DEFAULT_BUDGET = 16
DEFAULT_COUNTERFACTUAL_BUDGETS = "8,16,32,64,chain"
DEFAULT_COUNTERFACTUAL_FRACTION = 0.05  # one greedy round in 20: ~400 rounds scored per 8k rounds served


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", "--model", dest="model_path", required=True, help="target model directory")
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "half"])
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-level-http", default=None)
    p.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--watchdog-timeout", type=float, default=300)
    p.add_argument("--skip-server-warmup", action="store_true")
    p.add_argument("--enable-metrics", action="store_true")
    # memory / scheduling
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    # CUDA graphs (0.5.20+ spelling; --disable-cuda-graph is still accepted, deprecated)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--cuda-graph-max-bs-decode", type=int, default=None)
    p.add_argument("--cuda-graph-max-bs-prefill", type=int, default=None)
    p.add_argument("--cuda-graph-bs-decode", type=int, nargs="+", default=None)
    p.add_argument("--cuda-graph-bs-prefill", type=int, nargs="+", default=None)
    # speculative decoding
    p.add_argument("--speculative-algorithm", default=None)
    p.add_argument(
        "--speculative-draft-model-path", "--speculative-draft-model", dest="speculative_draft_model_path"
    )
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--speculative-dflash-block-size", type=int, default=None)
    p.add_argument("--speculative-num-steps", type=int, default=None)
    p.add_argument("--speculative-eagle-topk", type=int, default=None)
    # The plugin's three spellings parse here too (a rendered unit's flags always parse); the lab engine
    # runs one width and refuses auto or a list at resolve, with one line (lab_budget).
    p.add_argument("--speculative-ddtree-budget", type=_budget_word, default=None)
    p.add_argument("--speculative-ddtree-topk-cap", type=int, default=None)
    # counterfactual acceptance (docs/counterfactual-acceptance.md): the budgets scored on a sampled
    # fraction of greedy rounds, whatever the server decodes with; fraction 0 turns it off
    p.add_argument("--speculative-ddtree-counterfactual-budgets", default=DEFAULT_COUNTERFACTUAL_BUDGETS)
    p.add_argument(
        "--speculative-ddtree-counterfactual-fraction", type=float, default=DEFAULT_COUNTERFACTUAL_FRACTION
    )
    # mamba knobs (hybrid targets; accepted and reported: the lab's hybrid target keeps its GDN state in
    # full precision per request, with no separate cache pool)
    p.add_argument("--mamba-ssm-dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--max-mamba-cache-size", type=int, default=None)
    p.add_argument("--mamba-full-memory-ratio", type=float, default=0.9)
    p.add_argument(
        "--mamba-radix-cache-strategy",
        choices=["auto", "no_buffer", "extra_buffer", "extra_buffer_lazy"],
        default="auto",
    )
    p.add_argument("--mamba-track-interval", type=int, default=256)
    p.add_argument("--mamba-backend", choices=["triton", "flashinfer"], default="triton")
    # the lab's own
    p.add_argument("--lab-fault", default=None, help="a lab fault (else DDTREE_LAB_FAULT); see faults.py")


class ServerArgsError(ValueError):
    """A flag combination SGLang refuses after parsing (it raises ValueError at resolve time)."""


def _budget_word(text: str) -> int | str:
    """A number as a number, any other word as it is (``auto``, ``15,31``: :func:`lab_budget` decides)."""
    return int(text) if text.isascii() and text.isdigit() else text


def lab_budget(value: int | str | None) -> int:
    """The one width the lab engine verifies: the flag's number, else LAB_DEFAULT_BUDGET. ServerArgsError, one
    line, for ``auto`` or a list (the SGLang plugin's adaptive widths) and for what no spelling takes."""
    if value is None:
        return LAB_DEFAULT_BUDGET
    try:
        spec = parse_budget(value)
    except SettingsError as exc:
        raise ServerArgsError(str(exc)) from None
    if not isinstance(spec, int):
        shown = spec if spec == AUTO else ",".join(map(str, spec))
        raise ServerArgsError(f"the lab engine verifies one width; --speculative-ddtree-budget {shown} runs "
                              "in the SGLang plugin (give one number here)")  # fmt: skip
    return spec


def resolve(args: argparse.Namespace, *, target_config: dict, draft_block_size: int | None) -> dict:
    """Resolved flat server args, as SGLang's /server_info reports them."""
    algo = (args.speculative_algorithm or "NONE").upper()
    if algo not in ("NONE", "DFLASH", "DDTREE"):
        raise ServerArgsError(f"Unknown speculative algorithm name: {args.speculative_algorithm}")
    if algo != "NONE" and not args.speculative_draft_model_path:
        raise ServerArgsError(
            f"--speculative-draft-model-path is required for --speculative-algorithm {algo}"
        )
    if args.tp_size != 1:
        raise ServerArgsError(f"the lab engine runs on one device; --tp-size {args.tp_size} is not supported")
    block = args.speculative_dflash_block_size or draft_block_size or 16
    budget = args.speculative_ddtree_budget
    if algo == "DDTREE":
        budget = lab_budget(budget)
    num_draft = {"DFLASH": block, "NONE": None}.get(algo)
    if algo == "DDTREE":
        try:
            decoder = DecoderSettings.resolve(budget, block, args.speculative_ddtree_topk_cap)
        except SettingsError as exc:
            raise ServerArgsError(str(exc)) from None
        num_draft = decoder.verify_rows  # the lab engine reports the verify rows here (SGLang: its KV window)
    fraction = args.speculative_ddtree_counterfactual_fraction
    if not 0.0 <= fraction <= 1.0:  # NaN fails this too
        raise ServerArgsError(
            f"--speculative-ddtree-counterfactual-fraction must be in [0, 1], got {fraction}"
        )
    try:
        from ddtree_runtime.core.counterfactual import parse_candidates

        parse_candidates(args.speculative_ddtree_counterfactual_budgets, block - 1)
    except ValueError as exc:
        raise ServerArgsError(f"--speculative-ddtree-counterfactual-budgets: {exc}") from None
    mrr = args.max_running_requests
    if mrr is None:
        mrr = DEFAULT_MAX_RUNNING_DFLASH if algo != "NONE" else 64
    if mrr < 1:
        raise ServerArgsError(f"--max-running-requests must be >= 1, got {mrr}")
    out = {k: v for k, v in vars(args).items() if k not in ("func",)}
    out.update(
        speculative_algorithm=None if algo == "NONE" else algo,
        speculative_num_draft_tokens=num_draft,
        speculative_dflash_block_size=block if algo != "NONE" else None,
        speculative_num_steps=1 if algo != "NONE" else None,
        speculative_eagle_topk=1 if algo != "NONE" else None,
        speculative_ddtree_budget=budget,
        max_running_requests=mrr,
        mem_fraction_static=args.mem_fraction_static or DEFAULT_MEM_FRACTION,
        context_length=args.context_length or int(target_config.get("max_position_embeddings", 32768)),
        tokenizer_path=args.tokenizer_path or args.model_path,
        served_model_name=args.served_model_name or args.model_path,
    )
    return out


@dataclass(frozen=True)
class MemoryPlan:
    device_total_bytes: int
    weight_bytes: int
    kv_bytes_per_token: int
    max_total_num_tokens: int


def memory_plan(
    *,
    mem_fraction_static: float,
    context_length: int,
    target_config: dict,
    draft_layers: int,
    weight_bytes: int,
    env: dict[str, str] | None = None,
) -> MemoryPlan:
    """SGLang's pool sizing on the notional lab device; RuntimeError with SGLang's message when too small."""
    env = dict(os.environ if env is None else env)
    total = int(float(env.get("DDTREE_LAB_DEVICE_MEMORY_MB") or DEFAULT_DEVICE_MEMORY_MB) * 2**20)
    layers = int(target_config["num_hidden_layers"])
    kv_heads = int(target_config.get("num_key_value_heads", target_config["num_attention_heads"]))
    head_dim = int(
        target_config.get("head_dim", target_config["hidden_size"] // target_config["num_attention_heads"])
    )
    per_token = 2 * layers * kv_heads * head_dim * 2  # K and V, bf16
    per_token = per_token * (layers + draft_layers) // layers  # draft KV shares the pool (DFlash scaling)
    budget = int(total * mem_fraction_static) - weight_bytes
    tokens = budget // per_token if budget > 0 else 0
    if tokens <= 0 or tokens < context_length:
        raise RuntimeError(
            "Not enough memory. Please try to increase --mem-fraction-static. "
            f"Current value: mem_fraction_static={mem_fraction_static}"
        )
    return MemoryPlan(total, weight_bytes, per_token, tokens)
