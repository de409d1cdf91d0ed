"""`python -m ddtree_runtime.sglang_plugin.check`: is DDTREE fully registered in this environment?

The runtime role runs it in every new release venv before the rollout goes on. It loads SGLang's
general plugins through the real entry-point discovery (as `sglang serve` does), then checks both
that SGLang knows DDTREE and that our registration finished: SGLang only logs a plugin that raised
half-way, and a missing import (a dependency left out of the venv) would otherwise pass unseen.
Exit 0 when registered, 1 when not (the reason on stderr).
`--known-only` (the lab) accepts a registration that stopped after DDTREE became known.
"""

from __future__ import annotations

import sys


def main(*, require_complete: bool = True) -> int:
    """``require_complete=False`` only asks that SGLang knows DDTREE: for the lab's SGLang, which is
    installed without torchvision and the CUDA stack, so the later registration steps (they import
    SGLang's scheduler modules) cannot finish there. Production keeps the full check."""
    try:
        import sglang
        from sglang.srt.plugins import load_plugins
    except ImportError as exc:
        print(f"DDTREE plugin check: SGLang is not importable ({exc})", file=sys.stderr)
        return 1
    load_plugins()
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from ddtree_runtime import __version__
    from ddtree_runtime.sglang_plugin.names import ALGORITHM
    from ddtree_runtime.sglang_plugin.registration import registration_complete

    try:
        SpeculativeAlgorithm.from_string(ALGORITHM)
    except ValueError as exc:
        print(
            f"DDTREE plugin check: SGLang does not know {ALGORITHM} ({exc}). Is ddtree-runtime installed in "
            "this venv, and is SGLANG_PLUGINS (if set) naming 'ddtree'?",
            file=sys.stderr,
        )
        return 1
    if not registration_complete():
        if not require_complete:
            print(f"{ALGORITHM} known to SGLang {sglang.__version__}; registration incomplete (allowed here)")
            return 0
        print(
            f"DDTREE plugin check: SGLang knows {ALGORITHM} but the plugin's registration did not finish "
            "(see 'Failed to execute general plugin: ddtree' above: usually a module SGLang imports is "
            "missing from this venv)",
            file=sys.stderr,
        )
        return 1
    print(f"{ALGORITHM} registered (sglang {sglang.__version__}, ddtree-runtime {__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main(require_complete="--known-only" not in sys.argv[1:]))
