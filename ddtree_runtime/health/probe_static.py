"""`ddtree probe static`: the model pair on disk agrees on the hidden-state contract (configs and the
drafter's safetensors header), read before a restart. Host side: stdlib only (plus our contract).
"""

from __future__ import annotations

import errno
import os

from ddtree_runtime.health.probe_report import EXIT_BAD_INPUT, Report

# Contract causes that an operator knows under a diagnose id (a repeated layer id is a width mismatch
# at run time: SGLang captures the layer once).
_CONTRACT_CAUSE = {"fc_width_mismatch": "hidden_width_mismatch",
                   "layer_ids_repeated": "hidden_width_mismatch"}


def static_probe(model_path: str, draft_model_path: str) -> Report:
    report = Report("static")
    for label, path in (("--model-path", model_path), ("--draft-model-path", draft_model_path)):
        problem = _model_dir_problem(path)
        if problem:
            report.fail(EXIT_BAD_INPUT, "bad_input", f"{label} {path}: {problem}")
            return report
    from ddtree_runtime.core.contract import load_contract
    from ddtree_runtime.core.model_files import ContractError

    try:
        contract = load_contract(model_path, draft_model_path, check=False)  # we report the widths
    except ContractError as exc:
        cause = getattr(exc, "cause", "bad_config")
        report.check("contract", False, f"{exc} [{cause}]", _CONTRACT_CAUSE.get(cause, cause))
        return report
    c = contract.to_dict()
    report.figures.update(c)
    report.handshake = {
        "algorithm": "DDTREE", "block_size": contract.block_size,
        "target_hidden_size": contract.target_hidden_size,
        "target_layer_ids": list(contract.target_layer_ids),
        "expected_hidden_width": contract.capture_width,
        "draft_fc_in_features": contract.fc_in_features,
        "target_hybrid": contract.hybrid,
    }
    report.check("contract", True, f"configs and drafter fc.weight header read; "
                 f"warnings: {'; '.join(contract.warnings) or 'none'}")
    report.check("capture_width", contract.capture_width == contract.fc_in_features,
                 f"target captures [N, {contract.capture_width}] ({len(contract.target_layer_ids)} layers x "
                 f"{contract.target_hidden_size}), drafter fc expects [N, {contract.fc_in_features}]",
                 "hidden_width_mismatch")
    report.check("block_size", contract.block_size >= 2,
                 f"block_size {contract.block_size} (the tree needs a horizon of at least 1)", "bad_config")
    if report.ok:
        report.message = (f"model pair agrees: capture width {contract.capture_width}, "
                          f"block size {contract.block_size}{', hybrid target' if contract.hybrid else ''}")
    return report


def _model_dir_problem(path: str) -> str | None:
    """Why a model path given on the command line is not one (bad input), or None."""
    if not path:
        return "empty path; pass the model directory (HF layout)"
    try:
        os.stat(os.path.join(path, "config.json"))
    except FileNotFoundError:
        return "no config.json there; pass the model directory (HF layout)"
    except NotADirectoryError:
        return "not a directory; pass the model directory (HF layout)"
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            return "permission denied; run the probe as a user that can read the model directories"
        return f"cannot read it: {exc.strerror or exc}"
    except ValueError as exc:  # e.g. a NUL byte in the path
        return f"not a usable path ({exc})"
    return None
