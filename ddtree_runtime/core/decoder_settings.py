"""The decoder's settings, in one place: the tree budget, the drafter's block and the top-K cap, the one
rule that resolves them (verify rows, the KV reservation, whether it is the chain) and their limits.

The budget's way from a profile to the round (docs/interfaces.md §1b):
``roles/sglang_service/vars/profiles.yml`` ``speculative-ddtree-budget`` -> the launch flag
``--speculative-ddtree-budget`` (``sglang_plugin/cli_args.py``: parsed, at most :data:`MAX_BUDGET`) ->
:meth:`DecoderSettings.resolve` at SGLang's start-up (``sglang_plugin/algorithm.resolve_server_args``:
the default, the drafter's block, the sizes SGLang reserves) -> the worker (``DDTreeWorker.ddtree_settings``,
a ``PluginSettings`` whose ``decoder`` is this type) -> ``RoundConfig.from_settings``
(``sglang_plugin/round/tree_round.py``). The planner (``planner/settings.resolve``), the lab engine
(``tiny_engine/server_args.resolve``), the counterfactual scorer's candidates (``core/counterfactual``),
``ddtree tune``'s labels and runnable settings, and the probe's per-round bound read the same rule.

Standard library only: the planner and the operator tools run without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

# The limits, each stated once.
#
# MAX_BUDGET: the largest budget anything of ours accepts (the plugin's flag, the lab engine's, the planner's
# profiles, the scorer's candidates, `ddtree tune`'s labels). The verify width budget + 1 is a per-request
# token count in every target forward, and SGLang's tree kernels and CUDA-graph buffers are sized by it;
# beyond 1024 rows the verify pass is certainly slower than it gains (ddtree-algorithm.md section 4: the
# best budgets are 4..256). Above it a value is refused, never cut.
MAX_BUDGET = 1023
# VALIDATED_MAX_BUDGET: the largest tree budget the H200 suite has shown token-identical to the plain server
# with CUDA graphs on (tests/gpu/test_real_server_gpu.py); at 64 one lab prompt differed
# (docs/bench/gpu-lab-server.md). Above it the plugin still starts, with a warning, and `ddtree tune` never
# proposes it. The chain is exempt: it is DFlash's own decode.
VALIDATED_MAX_BUDGET = 32
# The drafter's block (bonus + L mask positions): at least one drafted position; at most what a planner
# or an operator tool takes as plausible (beyond it a flag is a typo).
MIN_BLOCK_SIZE = 2
MAX_BLOCK_SIZE = 1024
CHAIN = "chain"  # the chain's label: top-K cap 1 at budget block - 1 (DFlash's argmax chain)
AUTO = "auto"  # the adaptive spelling of the budget flag: the widths :func:`auto_widths` names
MAX_WIDTHS = 4  # widths one adaptive server verifies at most (each costs graphs and a price table)


class SettingsError(ValueError):
    """A budget, block or top-K cap outside its limits; the message names the flag, the value and the rule."""


def default_budget(block_size: int) -> int:
    """The SGLang plugin's default budget: one node per draft position (block - 1), so the default tree is
    as wide as DFlash's chain is long. The lab engine keeps a fixed default of its own
    (``tiny_engine/server_args.LAB_DEFAULT_BUDGET``)."""
    return block_size - 1


def auto_widths(block_size: int) -> tuple[int, ...]:
    """What ``--speculative-ddtree-budget auto`` verifies: block - 1 and 2 x block - 1 (16 and 32 verify
    rows for a block of 16: whole tiles of the verify's 16-row GEMM and attention blocks), the wider
    capped at :data:`MAX_BUDGET`; one width where the two coincide."""
    narrow = default_budget(block_size)
    wide = min(2 * block_size - 1, MAX_BUDGET)
    return (narrow,) if wide <= narrow else (narrow, wide)


def parse_budget(text: object, *, what: str = "--speculative-ddtree-budget") -> int | str | tuple[int, ...]:
    """The budget flag's three spellings: a whole number (one width), ``auto``, or a comma list of two to
    :data:`MAX_WIDTHS` budgets (``15,31``: the widths an adaptive server picks from each round, returned
    sorted). SettingsError, naming ``what`` and the value, for anything else; limits are checked where the
    block is known (:meth:`DecoderSettings.resolve`)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    if isinstance(text, tuple | list):
        parts = [str(p) for p in text]
    elif isinstance(text, str):
        word = text.strip()
        if word == AUTO:
            return AUTO
        parts = word.split(",")
    else:
        raise SettingsError(f"{what} takes a whole number, '{AUTO}' or a comma list of budgets, got {text!r}")
    values = []
    for part in parts:
        part = part.strip()
        if not part.isascii() or not part.isdigit():
            shown = ascii(text)[:60]
            raise SettingsError(f"{what} takes a whole number, '{AUTO}' or a comma list (15,31), got {shown}")
        values.append(int(part))
    if len(values) == 1:
        return values[0]
    if len(set(values)) != len(values) or len(values) > MAX_WIDTHS:
        raise SettingsError(
            f"{what} lists {ascii(text)[:60]}: give 2..{MAX_WIDTHS} different budgets, each once"
        )
    return tuple(sorted(values))


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class DecoderSettings:
    """What a DDTREE server decodes with (SGLang's and the lab engine's alike).

    ``budget``: tree nodes per request and round, the root not counted; ``block_size``: the drafter's block
    (bonus + L = block - 1 mask positions); ``topk_cap``: at most this many candidates per draft depth
    (None: the budget)."""

    budget: int
    block_size: int
    topk_cap: int | None = None
    # Adaptive: the budgets the server may verify, narrowest first, ``budget`` the widest (it sizes the
    # KV window); each round verifies the one that pays at its batch size (core/width_policy). (): one.
    widths: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not _whole(self.block_size) or not MIN_BLOCK_SIZE <= self.block_size <= MAX_BLOCK_SIZE:
            raise SettingsError(
                f"the drafter block must be a whole number in {MIN_BLOCK_SIZE}..{MAX_BLOCK_SIZE}, "
                f"got {self.block_size!r}"
            )
        if not _whole(self.budget) or not 1 <= self.budget <= MAX_BUDGET:
            raise SettingsError(
                f"--speculative-ddtree-budget must be a whole number in 1..{MAX_BUDGET} "
                f"(verify width = budget + 1), got {self.budget!r}"
            )
        if self.topk_cap is not None and (not _whole(self.topk_cap) or self.topk_cap < 1):
            raise SettingsError(f"--speculative-ddtree-topk-cap must be at least 1, got {self.topk_cap!r}")
        if self.widths:
            self._check_widths()

    def _check_widths(self) -> None:
        w = self.widths
        if not isinstance(w, tuple) or not 2 <= len(w) <= MAX_WIDTHS or not all(_whole(b) for b in w):
            raise SettingsError(f"adaptive widths {w!r}: give 2..{MAX_WIDTHS} whole budgets")
        if list(w) != sorted(set(w)) or w[-1] != self.budget:
            raise SettingsError(f"adaptive widths {w!r}: each once, narrowest first, the widest = the budget")
        if w[0] < 1:
            raise SettingsError(f"adaptive widths {w!r}: every budget is at least 1")
        if self.topk_cap == 1:
            raise SettingsError(
                "--speculative-ddtree-topk-cap 1 is the chain, which has one width: drop the cap or give "
                "--speculative-ddtree-budget one number"
            )

    @classmethod
    def resolve(
        cls, budget: int | str | tuple[int, ...] | None, block_size: int, topk_cap: int | None = None
    ) -> DecoderSettings:
        """The one resolve rule: a budget not given is :func:`default_budget` of the block; ``auto`` is
        :func:`auto_widths` of the block; a list (or its text, ``15,31``) is those widths (adaptive)."""
        if budget is None:
            return cls(default_budget(block_size), block_size, topk_cap)
        spec = parse_budget(budget)
        if spec == AUTO:
            if not _whole(block_size) or not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
                return cls(1, block_size, topk_cap)  # __post_init__ names the block
            spec = auto_widths(block_size)
            if len(spec) == 1:
                return cls(spec[0], block_size, topk_cap)
        if isinstance(spec, tuple):
            for b in spec:
                cls(b, block_size, topk_cap)  # each width within the limits, its message if not
            return cls(spec[-1], block_size, topk_cap, spec)
        return cls(spec, block_size, topk_cap)

    @classmethod
    def chain(cls, block_size: int) -> DecoderSettings:
        """DFlash's argmax chain as DDTREE spells it: top-K cap 1 at budget block - 1."""
        return cls(default_budget(block_size), block_size, 1)

    @property
    def adaptive(self) -> bool:
        """More than one width: each round verifies the one its batch size pays for."""
        return bool(self.widths)

    @property
    def budgets(self) -> tuple[int, ...]:
        """Every budget the server may verify, narrowest first (one for a fixed setting)."""
        return self.widths or (self.budget,)

    def at_budget(self, budget: int) -> DecoderSettings:
        """One of :attr:`budgets` as a fixed setting (what a round of that width decodes with)."""
        if budget not in self.budgets:
            raise SettingsError(f"budget {budget} is not one of this server's widths {list(self.budgets)}")
        return DecoderSettings(budget, self.block_size, self.topk_cap)

    @property
    def horizon(self) -> int:
        """L: drafted positions per round (the deepest a tree reaches)."""
        return self.block_size - 1

    @property
    def is_chain(self) -> bool:
        """The chain case (top-K cap 1, budget = block - 1): exactly DFlash's argmax chain, which the plugin
        decodes with DFlash's own code."""
        return self.topk_cap == 1 and self.budget == self.block_size - 1

    @property
    def verify_rows(self) -> int:
        """Rows per request the target verifies each round: the tree and its root."""
        return self.budget + 1

    @property
    def kv_window(self) -> int:
        """KV rows SGLang reserves per request and round (``speculative_num_draft_tokens``): the drafter's
        block and the tree's verify both write into it."""
        return max(self.verify_rows, self.block_size)

    @property
    def max_tokens_per_round(self) -> int:
        """The most tokens one round emits per request: the accepted path (at most the horizon and at most
        the budget) and the bonus token."""
        return min(self.budget, self.horizon) + 1

    @property
    def validated(self) -> bool:
        """Within what the GPU suite has shown lossless (the chain always is)."""
        return self.is_chain or self.budget <= VALIDATED_MAX_BUDGET

    @property
    def label(self) -> str | None:
        """The canonical label (``chain`` or the decimal budget) ``ddtree tune`` and the counterfactual
        counters use; None for a capped tree or an adaptive server, which no one label names."""
        if self.is_chain:
            return CHAIN
        return str(self.budget) if self.topk_cap is None and not self.widths else None

    @property
    def shown(self) -> str:
        """The setting as the operator tools print it: its label (``chain``, ``16``), ``16 (top-K cap 4)``
        for a capped tree, :func:`widths_text` for an adaptive server (``auto(15,31)``)."""
        text = widths_text(self.widths, self.block_size) if self.widths else self.label or str(self.budget)
        return text if self.topk_cap is None or self.is_chain else f"{text} (top-K cap {self.topk_cap})"

    @property
    def budget_flag(self) -> int | str:
        """The budget flag's value: the number, or the widths as a comma list (``15,31``)."""
        return ",".join(str(b) for b in self.widths) if self.widths else self.budget

    def flags(self) -> dict[str, int | str | None]:
        """The two profile flags that select it (profiles.yml spelling; None leaves a flag out)."""
        return {"speculative-ddtree-budget": self.budget_flag, "speculative-ddtree-topk-cap": self.topk_cap}


def widths_text(widths: tuple[int, ...] | list[int], block_size: int | None) -> str:
    """Adaptive widths as the operator tools print them: ``auto(15,31)`` when they are what ``auto`` picks
    for the drafter's block (:func:`auto_widths`), else the comma list the flag takes (``15,23,31``)."""
    listed = ",".join(str(b) for b in widths)
    known = block_size is not None and MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE
    return f"{AUTO}({listed})" if known and tuple(widths) == auto_widths(block_size) else listed


def parse_label(text: object, *, what: str = "a setting") -> str:
    """A canonical label: ``chain`` or a decimal budget 1..MAX_BUDGET in ASCII digits without a leading zero
    (``16``; not ``016``, ``+16``, ``16.0`` or another script's digits). Returns it unchanged; SettingsError,
    one line naming ``what`` and the value, for anything else."""
    if text == CHAIN:
        return CHAIN
    shown = ascii(text)[:60]
    if not isinstance(text, str) or not text.isascii() or not text.isdigit() or text.startswith("0"):
        raise SettingsError(f"{what} {shown} is neither 'chain' nor a decimal budget 1..{MAX_BUDGET}")
    if int(text) > MAX_BUDGET:
        raise SettingsError(f"{what} {shown} is above the largest budget, {MAX_BUDGET}")
    return text


def settings_for_label(label: str, block_size: int) -> DecoderSettings:
    """The settings a canonical label names, for a drafter of ``block_size``."""
    if parse_label(label) == CHAIN:
        return DecoderSettings.chain(block_size)
    return DecoderSettings(int(label), block_size)
