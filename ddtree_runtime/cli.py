"""The `ddtree` command: one argparse tree, each verb owned by the module that implements it.

Every module listed here exposes ``register(subparsers)``, which adds its parsers and sets
``func`` (called with the parsed namespace, returns the exit code). Modules must keep heavy
imports (torch, paramiko) inside their handlers so that `ddtree --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# verb -> modules that register sub-verbs under it ("" = register at top level)
_TOP_LEVEL = (
    "ddtree_runtime.tree_cli",
    "ddtree_runtime.health.probe",
    "ddtree_runtime.health.diagnose",
    "ddtree_runtime.planner.cli",
    "ddtree_runtime.health.metrics",
    "ddtree_runtime.ops.fleet",
    "ddtree_runtime.health.canary",
    "ddtree_runtime.tune_cli",
)
# One group per thing driven: the tiny engine (host side, what a lab host's release runs) and the lab
# hosts (controller side, the nspawn machines).
_TINY_ENGINE = ("ddtree_runtime.tiny_engine.cli",)  # make-models, serve, bench
_LAB = ("ddtree_runtime.ops.labhosts.hosts",)  # up, down, status, wheelhouse


def _register_all(modules: tuple[str, ...], subparsers: argparse._SubParsersAction) -> None:
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # A module that is not written yet, or an optional dependency missing on this host
            # (paramiko is controller-only): its verbs are simply absent.
            if exc.name and (exc.name == name or not exc.name.startswith("ddtree_runtime")):
                continue
            raise
        module.register(subparsers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddtree",
        description="DDTree deploy toolkit: trees, probes, diagnosis, metrics, canary, fleet, the tiny "
        "engine and the lab hosts.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _register_all(_TOP_LEVEL, sub)
    engine = sub.add_parser("tiny-engine", help="the tiny engine: its models, its SGLang-style server, bench")
    engine_sub = engine.add_subparsers(dest="engine_command", metavar="ENGINE_COMMAND")
    engine.set_defaults(func=lambda _args: (engine.print_help(), 2)[1])
    _register_all(_TINY_ENGINE, engine_sub)
    lab = sub.add_parser("lab", help="the lab hosts: boot, remove, status, their wheelhouse")
    lab_sub = lab.add_subparsers(dest="lab_command", metavar="LAB_COMMAND")
    lab.set_defaults(func=lambda _args: (lab.print_help(), 2)[1])
    _register_all(_LAB, lab_sub)
    _register_old_spellings(lab_sub)
    return parser


def _register_old_spellings(lab_sub: argparse._SubParsersAction) -> None:
    """`ddtree lab serve | make-models | bench`, the tiny engine's verbs before they had a group of their
    own: units and scripts written before still call them (a lab host's unit names its own release's
    CLI). Not listed in the help."""
    from ddtree_runtime.tiny_engine import cli as tiny_engine_cli

    tiny_engine_cli.register(lab_sub, listed=False)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
