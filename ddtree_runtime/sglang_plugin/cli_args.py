"""DDTREE's launch flags, added to SGLang's own parser.

SGLang 0.5.23 assembles ``ServerArgs`` from fixed namespaces at import time, so a plugin cannot
declare new fields. The flags are therefore added to the parser SGLang builds
(``ServerArgs.add_cli_args``, hooked) and read back from the parsed namespace
(``ServerArgs.from_cli_args``, hooked) onto a bookkeeping attribute of the record. Bookkeeping
attributes travel with the record when SGLang pickles it to its scheduler processes.
Resolution (``algorithm.resolve_server_args``) turns them, with the drafter's block, into the decoder's
settings (``core/decoder_settings.DecoderSettings.resolve``: the default budget, the limits) and SGLang's
own fields: ``speculative_num_draft_tokens`` = the KV window max(budget + 1, block) and
``speculative_dflash_block_size`` = the drafter's block.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any

from ddtree_runtime.core.counterfactual import DEFAULT_BUDGETS, DEFAULT_FRACTION
from ddtree_runtime.core.decoder_settings import AUTO, MAX_BUDGET, MAX_WIDTHS, SettingsError, parse_budget

# The SGLang plugin scores no round unless asked: the hook landed in a session without a device, so
# neither the whole GPU suite with it on nor its cost at the production shape has run yet (issue 41).
# The GPU suite's tree servers turn it on (DEFAULT_FRACTION); make it the default once both have run.
PLUGIN_DEFAULT_FRACTION = 0.0

RECORD_ATTR = "_ddtree_cli"


@dataclass(frozen=True)
class DDTreeArgs:
    """The DDTREE flags as parsed: what the operator asked for, before the drafter's block is known."""

    # None: decoder_settings.default_budget (block - 1); "auto" or a tuple: adaptive widths.
    budget: int | str | tuple[int, ...] | None = None
    topk_cap: int | None = None
    allow_hybrid: bool = False
    # Counterfactual acceptance (docs/counterfactual-acceptance.md): checked at resolution
    # (core/counterfactual.CounterfactualSettings.resolve), where the drafter's horizon is known.
    counterfactual_fraction: float = PLUGIN_DEFAULT_FRACTION
    counterfactual_budgets: str = DEFAULT_BUDGETS
    # The start-up price table (price_table.py): off until the GPU suite has run it (issue 41).
    price_table: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _positive_int(name: str, maximum: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes a whole number, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be at least 1, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(
                f"{name} must be at most {maximum} (verify width = budget + 1), got {value}"
            )
        return value

    return parse


def add_ddtree_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the DDTREE flags to SGLang's parser (idempotent)."""
    if any("--speculative-ddtree-budget" in a.option_strings for a in parser._actions):
        return
    group = parser.add_argument_group("DDTREE speculative decoding (ddtree-runtime plugin)")
    group.add_argument(
        "--speculative-ddtree-budget",
        type=_budget,
        default=None,
        help="DDTREE only. Tree nodes per request and round (not counting the root); the target "
        f"verifies budget + 1 tokens, independent of the drafter's block size. At most {MAX_BUDGET}. "
        f"Default: block_size - 1. '{AUTO}' or a comma list of 2..{MAX_WIDTHS} budgets (15,31): adaptive, "
        "each round verifies the width that pays at its batch size, from the server's own prices and each "
        f"width's own acceptance ('{AUTO}': block - 1 and 2 x block - 1; docs/adaptive-width.md).",
    )
    group.add_argument(
        "--speculative-ddtree-topk-cap",
        type=_positive_int("--speculative-ddtree-topk-cap"),
        default=None,
        help="DDTREE only. At most this many candidate tokens per draft position (default: budget).",
    )
    group.add_argument(
        "--speculative-ddtree-allow-hybrid",
        action="store_true",
        default=False,
        help="DDTREE only. Start the chain case (--speculative-ddtree-topk-cap 1, budget = block - 1, "
        "decoded by DFlash's own code) on a hybrid target whose recurrent layers DDTREE does not "
        "verify trees on (Mamba2, KDA, lightning attention, ...). Gated DeltaNet hybrids "
        "(Qwen3-Next / Qwen3.5 / Qwen3.6) serve trees without it; no kind gets a tree through it.",
    )
    group.add_argument(
        "--speculative-ddtree-counterfactual-fraction",
        type=_fraction,
        default=PLUGIN_DEFAULT_FRACTION,
        help="DDTREE only. Fraction of greedy decode rounds on which every budget of "
        "--speculative-ddtree-counterfactual-budgets is scored against the real output "
        "(sglang:ddtree_counterfactual_* on /metrics with --enable-metrics, read by `ddtree tune`); "
        f"0 turns scoring off. Default {PLUGIN_DEFAULT_FRACTION} (off) for now; {DEFAULT_FRACTION} "
        "is what `ddtree tune` is sized for (one greedy round in 20).",
    )
    group.add_argument(
        "--speculative-ddtree-counterfactual-budgets",
        default=DEFAULT_BUDGETS,
        help="DDTREE only. Comma-separated tree budgets to score, `chain` for DFlash's chain "
        f"(top-k cap 1). Default {DEFAULT_BUDGETS}.",
    )
    group.add_argument(
        "--speculative-ddtree-price-table",
        type=_switch("--speculative-ddtree-price-table"),
        nargs="?",
        const=True,
        default=False,
        help="DDTREE only. At start-up, after the graphs are captured, time the tree round's verify and the "
        "rest of a round at each captured batch size (medians of a few runs) and publish the table on "
        "/server_info (internal_states[i].ddtree_prices) and /metrics (sglang:ddtree_price_*), where "
        "`ddtree tune --url` prices rounds with it. Default off for now (docs/price-table.md).",
    )


def _budget(text: str) -> int | str | tuple[int, ...]:
    """One budget, ``auto`` or a comma list (``core/decoder_settings.parse_budget``); a number is
    range-checked here, widths where the block is known (resolution)."""
    try:
        value = parse_budget(text)
    except SettingsError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if isinstance(value, int):
        return _positive_int("--speculative-ddtree-budget", MAX_BUDGET)(str(value))
    return value


TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")


def _switch(name: str):
    """A switch: bare (on), or one of TRUE_WORDS / FALSE_WORDS (a profile may write it out either way)."""

    def parse(text: str) -> bool:
        word = text.strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
        words = ", ".join(TRUE_WORDS + FALSE_WORDS)
        raise argparse.ArgumentTypeError(f"{name} is a switch: alone, or one of {words}; got {text!r}")

    return parse


def _fraction(text: str) -> float:
    """A number; its range is checked at resolution, with the budgets (one message for both)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--speculative-ddtree-counterfactual-fraction takes a number in [0, 1], got {text!r}"
        ) from None


def capture_ddtree_arguments(record: Any, namespace: argparse.Namespace) -> DDTreeArgs:
    """Store the parsed DDTREE flags on the ServerArgs record and return them."""
    args = DDTreeArgs(
        budget=getattr(namespace, "speculative_ddtree_budget", None),
        topk_cap=getattr(namespace, "speculative_ddtree_topk_cap", None),
        allow_hybrid=bool(getattr(namespace, "speculative_ddtree_allow_hybrid", False)),
        counterfactual_fraction=getattr(
            namespace, "speculative_ddtree_counterfactual_fraction", PLUGIN_DEFAULT_FRACTION
        ),
        counterfactual_budgets=str(
            getattr(namespace, "speculative_ddtree_counterfactual_budgets", DEFAULT_BUDGETS)
        ),
        price_table=bool(getattr(namespace, "speculative_ddtree_price_table", False)),
    )
    setattr(record, RECORD_ATTR, args.to_dict())
    return args


def ddtree_args_of(record: Any) -> DDTreeArgs:
    """The DDTREE flags stored on a ServerArgs record (defaults when none were parsed)."""
    raw = getattr(record, RECORD_ATTR, None) if record is not None else None
    return DDTreeArgs(**raw) if raw else DDTreeArgs()
