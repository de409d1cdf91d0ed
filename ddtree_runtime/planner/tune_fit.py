"""`ddtree tune`'s fit: does a candidate setting fit the host's GPUs, as `ddtree plan` decides? The profile's
flags (its running requests, context, state dtype, ...) with the candidate's budget and top-K cap, planned on
the host's GPUs; the reason when it does not fit. Stdlib only, like the rest of the planner."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ddtree_runtime.core.decoder_settings import DecoderSettings
from ddtree_runtime.planner import gpus as gpu_facts
from ddtree_runtime.planner.accounting import plan_memory
from ddtree_runtime.planner.cli import load_profiles, parse_json, read_input
from ddtree_runtime.planner.settings import from_flags
from ddtree_runtime.planner.shapes import ModelPair, PlanError, model_pair_from_description
from ddtree_runtime.planner.tune import Fit

_DECODER_FLAGS = ("speculative-ddtree-budget", "speculative-ddtree-topk-cap")


def _flag(name: Any) -> str:
    return str(name).lstrip("-").replace("_", "-")


def host_fit(pair: ModelPair, gpus: list[gpu_facts.GpuFacts], flags: Mapping[str, Any], where: str) -> Fit:
    """A fit check for the settings ``ddtree tune`` may propose: ``flags`` (a profile's) with each setting's
    decoder flags, planned on ``gpus``. PlanError when the flags themselves cannot be planned."""
    base = {_flag(k): v for k, v in flags.items() if _flag(k) not in _DECODER_FLAGS}
    from_flags(base)  # the profile's own flags are checked now, not once per setting

    def fit(settings: DecoderSettings) -> str | None:
        chosen = {**base, **{k: v for k, v in settings.flags().items() if v is not None}}
        verdict = plan_memory(pair, gpus, from_flags(chosen), profile="tune").verdict
        return None if verdict.fits else f"does not fit {where} (ddtree plan): {verdict.message}"

    return fit


def load_host_fit(models_json: str, *, profile: str | None, profiles_file: str | None, gpus: str | None,
                  gpu: str, tp: int) -> tuple[Fit, DecoderSettings | None]:  # fmt: skip
    """``--models-json`` (``model_files.py describe``'s output), the profile's flags and the GPUs (``--gpus``,
    else the profile's ``runs_on.gpus``, else ``--tp`` x ``--gpu``) -> the fit check, and the settings the
    profile runs (None without a profile). PlanError on input the planner refuses."""
    pair = model_pair_from_description(parse_json(read_input(models_json), "--models-json", dict))
    flags: dict[str, Any] = {}
    runs = None
    spec = gpus
    if profile is not None:
        profiles = load_profiles(profiles_file)
        if profile not in profiles:
            raise PlanError(f"unknown profile {profile!r}; profiles: {', '.join(profiles)}")
        flags = dict(profiles[profile].get("flags") or {})
        spec = spec or (profiles[profile].get("runs_on") or {}).get("gpus")
        runs = profile_settings(flags, pair.draft.block_size)
    spec = spec or f"{tp}x{gpu}"
    host = gpu_facts.parse_shorthand(str(spec))
    where = str(spec) + (f" at profile {profile}'s flags" if profile else "")
    return host_fit(pair, host, flags, where), runs


def profile_settings(flags: Mapping[str, Any], block_size: int) -> DecoderSettings:
    """The decoder settings a profile's flags run (a number, ``auto`` or a list of widths: the one rule);
    SettingsError for flags the plugin refuses."""
    norm = {_flag(k): v for k, v in flags.items()}
    block = norm.get("speculative-dflash-block-size") or block_size
    return DecoderSettings.resolve(norm.get("speculative-ddtree-budget"), int(block),
                                   norm.get("speculative-ddtree-topk-cap"))  # fmt: skip


def profile_label(flags: Mapping[str, Any], block_size: int) -> str | None:
    """The label of the setting a profile's flags run (None: a capped tree or adaptive widths, which no
    label names)."""
    return profile_settings(flags, block_size).label
