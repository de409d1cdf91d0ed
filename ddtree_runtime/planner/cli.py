"""``ddtree plan``: will this profile fit these GPUs? The table (or ``--json``), the verdict, the fixes.

Exit codes: 0 fits, 1 does not fit (or only with a smaller context), 2 bad input. Inputs:

- the models: ``--model-path`` + ``--draft-model-path`` (read here), or ``--models-json FILE|-``
  (``python3 model_files.py describe TARGET DRAFT`` output, as a deploy gathers it from the host);
- the settings: ``--profile NAME`` (profiles.yml) or ``--flags-json``, then SGLang launch flags
  after ``--`` (``-- --tp-size 2 --mem-fraction-static 0.8``), then ``--tp-size``;
- the GPUs: ``--gpus 2xA6000``, ``--nvidia-smi FILE|-`` (its CSV), ``--gpus-json`` (the inventory's
  ``ddtree_gpus``); without any, this host's nvidia-smi, else the profile's ``runs_on``;
- a shadow beside a live service: ``--beside-profile``/``--beside-flags-json`` (+
  ``--beside-visible-devices``): the live server's claim is taken off the GPUs first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

from ddtree_runtime.inputs.launch_flags import split_launch_flags
from ddtree_runtime.inputs.values import InputError
from ddtree_runtime.planner import gpus as gpu_facts
from ddtree_runtime.planner.accounting import Plan, plan_memory
from ddtree_runtime.planner.fixes import propose_changes
from ddtree_runtime.planner.report import format_plan, plan_to_dict
from ddtree_runtime.planner.settings import ServeSettings, from_flags
from ddtree_runtime.planner.shapes import ModelPair, PlanError, load_model_pair, model_pair_from_description

PROFILES_FILE = Path(__file__).resolve().parents[2] / "roles" / "sglang_service" / "vars" / "profiles.yml"


def load_profiles(path: str | Path | None = None) -> dict[str, Any]:
    """``sglang_service_profiles`` from profiles.yml (the checkout's, unless ``path``)."""
    path = Path(path) if path else PROFILES_FILE
    try:
        import yaml
    except ModuleNotFoundError:
        raise PlanError(
            "reading profiles.yml needs PyYAML (pip install pyyaml); or pass --flags-json"
        ) from None
    if not path.exists():
        raise PlanError(f"{path} not found: pass --profiles FILE, or the flags with --flags-json")
    try:
        data = yaml.safe_load(read_input(str(path)))
    except yaml.YAMLError as exc:
        raise PlanError(f"{path} is not YAML: {str(exc)[:120]}") from None
    profiles = data.get("sglang_service_profiles") if isinstance(data, dict) else None
    if not isinstance(profiles, dict):
        raise PlanError(f"{path} has no sglang_service_profiles mapping")
    return profiles


def parse_launch_flags(argv: list[str]) -> dict[str, Any]:
    """``--name value`` / ``--name`` (boolean) pairs of an SGLang command line; an item ``--name value``
    (one word with a space, as ``sglang_extra_flags`` spells flags and the roles pass them) is the same."""
    try:
        words = split_launch_flags(argv, "launch flags")
    except InputError as exc:
        raise PlanError(f"cannot read {exc}") from None
    flags: dict[str, Any] = {}
    i = 0
    while i < len(words):
        word = words[i]
        if not word.startswith("--"):
            raise PlanError(f"cannot read launch flag {word!r}: write them as SGLang does, --name value")
        name, eq, value = word[2:].partition("=")
        if eq:
            flags[name] = value
        elif i + 1 < len(words) and not words[i + 1].startswith("--"):
            flags[name] = words[i + 1]
            i += 1
        else:
            flags[name] = True
        i += 1
    return flags


def _visible(text: str | None) -> list[int] | None:
    if text is None or str(text).strip() == "":
        return None
    ids = [x.strip() for x in str(text).split(",") if x.strip() != ""]
    if len(ids) > gpu_facts.MAX_GPUS or not all(x.isdigit() and len(x) <= 2 for x in ids):
        raise PlanError(f"visible devices must be GPU indices like 0,1 (got {str(text)[:60]!r})")
    devices = [int(x) for x in ids]
    if len(set(devices)) != len(devices):
        raise PlanError(f"visible devices {text!r} name a GPU twice: two ranks cannot share one GPU")
    return devices


# Inputs are small documents (a `model_files.py describe` table, nvidia-smi's CSV): a bigger one is a
# mistake, and a FIFO or a device in a file's place must not hang the planner.
MAX_INPUT_BYTES = 16 * 1024 * 1024


def read_input(source: str) -> str:
    if source == "-":
        raw = sys.stdin.buffer.read(MAX_INPUT_BYTES + 1)
    else:
        try:
            fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK)
        except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
            raise PlanError(f"cannot read {source}: {getattr(exc, 'strerror', None) or exc}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen: it refuses a directory its own way
            os.close(fd)
            raise PlanError(f"{source} is not a regular file: save the input to a file, or pipe it to '-'")
        with os.fdopen(fd, "rb") as fh:
            raw = fh.read(MAX_INPUT_BYTES + 1)
    if len(raw) > MAX_INPUT_BYTES:
        raise PlanError(f"{source} holds more than {MAX_INPUT_BYTES >> 20} MiB: not an input the planner "
                        "reads")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PlanError(f"{source} is not UTF-8 text (bad byte at offset {exc.start})") from None


def parse_json(text: str, what: str, kind: type | tuple[type, ...]) -> Any:
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise PlanError(f"{what} is not JSON ({str(exc)[:80]})") from None
    if not isinstance(doc, kind):
        kinds = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise PlanError(f"{what} must be a JSON {kinds}, got {str(doc)[:60]!r}")
    return doc


def _gpus(args: argparse.Namespace, runs_on: dict[str, Any] | None) -> list[gpu_facts.GpuFacts]:
    if args.gpus:
        return gpu_facts.parse_shorthand(args.gpus)
    if args.nvidia_smi:
        return gpu_facts.parse_nvidia_smi_csv(read_input(args.nvidia_smi))
    if args.nvidia_smi_csv is not None:
        return gpu_facts.parse_nvidia_smi_csv(args.nvidia_smi_csv)
    if args.gpus_json:
        return gpu_facts.from_declared(parse_json(args.gpus_json, "--gpus-json", (list, dict)))
    if shutil.which("nvidia-smi"):
        out = subprocess.run(gpu_facts.NVIDIA_SMI_COMMAND, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise PlanError(
                f"nvidia-smi failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}"
            )
        return gpu_facts.parse_nvidia_smi_csv(out.stdout)
    if runs_on and runs_on.get("gpus"):
        reference = gpu_facts.parse_shorthand(str(runs_on["gpus"]))
        if runs_on.get("free_mib"):  # a GPU other work shares
            free = int(runs_on["free_mib"])
            reference = [gpu_facts.GpuFacts(g.index, g.name, g.total_mib, free, "runs_on") for g in reference]
        return reference
    raise PlanError("which GPUs? give --gpus (e.g. 1xH200, 2xA6000), --nvidia-smi FILE or --gpus-json")


def _models(args: argparse.Namespace) -> ModelPair:
    if args.models_json:
        return model_pair_from_description(parse_json(read_input(args.models_json), "--models-json", dict))
    if not (args.model_path and args.draft_model_path):
        raise PlanError("give --model-path and --draft-model-path (or --models-json)")
    return load_model_pair(args.model_path, args.draft_model_path)


def _settings(
    args: argparse.Namespace,
    profiles: dict[str, Any] | None,
    name: str | None,
    flags_json: str | None,
    extra: list[str],
) -> ServeSettings:
    flags: dict[str, Any] = {}
    if name and not flags_json:  # with --flags-json the name only labels the plan
        if profiles is None:
            profiles = load_profiles(args.profiles)
        if name not in profiles:
            raise PlanError(f"unknown profile {name!r}; profiles: {', '.join(profiles)}")
        flags.update(profiles[name].get("flags") or {})
    if flags_json:
        flags.update(parse_json(flags_json, "the flags JSON", dict))
    flags.update(parse_launch_flags(extra))
    return from_flags(flags)


def plan_from_args(args: argparse.Namespace) -> tuple[Plan, list[Any], list[str]]:
    """The plan, the changes that make it fit and the other shipped profiles that fit as they are."""
    profiles = None
    runs_on = None
    if args.profile and not args.flags_json:
        profiles = load_profiles(args.profiles)
        runs_on = (profiles.get(args.profile) or {}).get("runs_on")
    pair = _models(args)
    extra = list(args.launch_flags or [])
    if extra and extra[0] == "--":
        extra = extra[1:]
    if args.tp_size is not None:
        extra += ["--tp-size", str(args.tp_size)]
    settings = _settings(args, profiles, args.profile, args.flags_json, extra)
    host_gpus = _gpus(args, runs_on)
    visible = _visible(args.visible_devices)
    # A profile's runs_on (its reference host, the live profile beside it, its GPUs there) applies when
    # no GPUs are given: with explicit GPUs, only what is asked for is planned.
    explicit = args.gpus or args.nvidia_smi or args.gpus_json or args.nvidia_smi_csv is not None
    on_reference = bool(runs_on) and not explicit
    beside = args.beside_profile or ((runs_on or {}).get("beside") if on_reference else None)
    if visible is None and on_reference:
        visible = _visible(runs_on.get("cuda_visible_devices"))
    claimed = None
    notes: tuple[str, ...] = ()
    if beside or args.beside_flags_json:
        beside_flags = args.beside_flags_json
        live_settings = _settings(args, profiles, None if beside_flags else beside, beside_flags, [])
        claimed = live_claim(pair, host_gpus, live_settings, _visible(args.beside_visible_devices))
        held = ", ".join(f"{gib:.1f} GiB on GPU {i}" for i, gib in sorted(claimed.items()))
        notes = (f"beside the live service ({beside or 'given flags'}), which holds {held}",)
    plan = plan_memory(
        pair, host_gpus, settings, profile=args.profile, visible=visible, claimed_gib=claimed, notes=notes
    )
    if args.no_proposals or plan.verdict.fits:
        return plan, [], []
    changes = propose_changes(plan, visible=visible, claimed_gib=claimed)
    return plan, changes, _fitting_profiles(args, profiles, pair, host_gpus, visible, claimed)


def _fitting_profiles(
    args: argparse.Namespace,
    profiles: dict[str, Any] | None,
    pair: ModelPair,
    host_gpus: list[gpu_facts.GpuFacts],
    visible: list[int] | None,
    claimed: dict[int, float] | None,
) -> list[str]:
    try:
        profiles = profiles if profiles is not None else load_profiles(args.profiles)
    except PlanError:
        return []  # no profiles file here (a bare host): the changes above still say what fits
    fitting = []
    for name, data in profiles.items():
        if name == args.profile or not isinstance(data, dict):
            continue
        try:
            other = plan_memory(
                pair,
                host_gpus,
                from_flags(data.get("flags") or {}),
                profile=name,
                visible=visible,
                claimed_gib=claimed,
            )
        except PlanError:
            continue
        if other.verdict.fits:
            fitting.append(name)
    return fitting


def live_claim(
    pair: ModelPair, host_gpus: list[gpu_facts.GpuFacts], live: ServeSettings, visible: list[int] | None
) -> dict[int, float]:
    """GiB the live server holds on each of its GPUs: context + static pools + its graph/activation estimate.

    Planned as at its own start (idle GPUs); what live leaves is the rest of each GPU's total.
    """
    idle = [gpu_facts.GpuFacts(g.index, g.name, g.total_mib, g.total_mib, g.source) for g in host_gpus]
    plan = plan_memory(pair, idle, live, profile="live", visible=visible)
    if not plan.used:
        raise PlanError(f"the live service's profile does not place on this host: {plan.verdict.message}")
    held = sum(plan.term(k).gib for k in ("context", "static") if plan.term(k))
    act, room = plan.term("activations"), plan.term("headroom")
    held += min(act.gib, room.gib) if act and room else 0.0
    return {g.index: held for g in plan.used}


def _run(args: argparse.Namespace) -> int:
    try:
        plan, changes, fitting = plan_from_args(args)
    except PlanError as exc:
        print(f"ddtree plan: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"ddtree plan: {exc}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError) as exc:
        # The last line of defence: input the checks above did not foresee is still bad input, one line.
        print(f"ddtree plan: bad input ({type(exc).__name__}: {str(exc)[:160]})", file=sys.stderr)
        return 2
    if args.json:
        doc = plan_to_dict(plan, changes)
        doc["fitting_profiles"] = fitting
        doc["table"] = format_plan(plan, changes, sources=args.sources, fitting=fitting)
        print(json.dumps(doc, indent=2))
    else:
        print(format_plan(plan, changes, sources=args.sources, fitting=fitting))
    return 0 if plan.verdict.fits else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="will a profile fit the GPUs? SGLang's per-GPU memory terms, the verdict and the fixes",
        description=__doc__.split("\n\n")[0] + " Exit 0: fits, 1: does not fit, 2: bad input.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  ddtree plan --model-path /srv/models/Qwen3.6-27B --draft-model-path "
        "/srv/models/Qwen3.6-27B-DFlash --profile balanced --gpus 1xH200\n"
        "  ddtree plan ... --gpus 2xA6000 -- --tp-size 2 --mamba-ssm-dtype bfloat16",
    )
    p.add_argument("--model-path", help="target model directory (config.json + safetensors)")
    p.add_argument("--draft-model-path", help="DFlash drafter directory")
    p.add_argument("--models-json", metavar="FILE",
                   help="`model_files.py describe` output instead ('-': stdin)")
    p.add_argument("--profile", help="a profile of profiles.yml (with --flags-json: only its name)")
    p.add_argument("--profiles", metavar="FILE", help=f"profiles file (default {PROFILES_FILE})")
    p.add_argument(
        "--flags-json", metavar="JSON", help="the flags as JSON, e.g. '{\"mem-fraction-static\": 0.8}'"
    )
    p.add_argument("--tp-size", type=int, default=None, help="tensor-parallel size (overrides the profile)")
    p.add_argument("--gpus", help="GPUs as COUNTxNAME: 1xH200, 2xA6000, 1xH100, ...")
    p.add_argument("--nvidia-smi", metavar="FILE", help="nvidia-smi --query-gpu CSV ('-': stdin)")
    p.add_argument("--nvidia-smi-csv", metavar="TEXT", help="the same CSV, inline")
    p.add_argument("--gpus-json", metavar="JSON", help="the inventory's ddtree_gpus as JSON")
    p.add_argument("--visible-devices", metavar="IDS", help="CUDA_VISIBLE_DEVICES of the server (e.g. 2,3)")
    p.add_argument("--beside-profile", metavar="NAME", help="plan beside a live service running this profile")
    p.add_argument("--beside-flags-json", metavar="JSON", help="the live service's flags as JSON")
    p.add_argument("--beside-visible-devices", metavar="IDS", help="the live service's CUDA_VISIBLE_DEVICES")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument("--sources", action="store_true", help="name the SGLang function behind each term")
    p.add_argument("--no-proposals", action="store_true", help="skip the search for changes that fit")
    p.add_argument("launch_flags", nargs=argparse.REMAINDER, help="SGLang flags after --")
    p.set_defaults(func=_run)
