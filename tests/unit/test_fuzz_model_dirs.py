"""Hostile and careless model directories against `ddtree probe static` (and so the contract reader).

A seeded generator plants one or two defects in a valid pair (broken JSON of every kind, wrong types,
absurd numbers, FIFOs and devices where files belong, hostile shard indexes, repeated or unsorted
layer ids, ...) and asserts the outcome class: never "ok", one clear line naming the cause, the
documented exit code (1 a check failed, 2 bad input), bounded time, no traceback. A few harmless
variations must still pass: the gate must not cry wolf either.
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ddtree_runtime.core.contract import load_contract
from ddtree_runtime.core.model_files import ContractError
from ddtree_runtime.health.probe_report import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_PASS
from ddtree_runtime.health.probe_static import static_probe
from tests.fixtures_models import write_header_only_safetensors, write_pair

SEEDS = range(64)  # BAD has 40 entries, GOOD 4: each is planted at least once, then random pairs
CLI_SEEDS = range(0, 64, 5)  # the same cases through the CLI: exit code and output, as an operator sees them

Mutation = Callable[[Path, Path], None]


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def _set(which: str, key: str, value: object, *, dflash: bool = False) -> Mutation:
    def mutate(target: Path, draft: Path) -> None:
        d = target if which == "target" else draft
        cfg = _config(d)
        (cfg.setdefault("dflash_config", {}) if dflash else cfg)[key] = value
        (d / "config.json").write_text(json.dumps(cfg))
    return mutate


def _raw_config(which: str, data: bytes) -> Mutation:
    def mutate(target: Path, draft: Path) -> None:
        (target if which == "target" else draft).joinpath("config.json").write_bytes(data)
    return mutate


def _replace(which: str, name: str, how: str) -> Mutation:
    """Put a FIFO, a device, a directory, a sparse giant or a dangling link where a file belongs."""
    def mutate(target: Path, draft: Path) -> None:
        path = (target if which == "target" else draft) / name
        path.unlink(missing_ok=True)
        if how == "fifo":
            os.mkfifo(path)
        elif how in ("zero", "urandom"):
            path.symlink_to(f"/dev/{how}")
        elif how == "dir":
            path.mkdir()
        elif how == "dangling":
            path.symlink_to(path.parent / "nowhere")
        elif how == "giant":
            with open(path, "wb") as fh:  # sparse: costs no disk, 40 MB to whoever reads it all
                fh.truncate(40 * 1024 * 1024)
    return mutate


def _safetensors(data: bytes) -> Mutation:
    def mutate(_target: Path, draft: Path) -> None:
        (draft / "model.safetensors").write_bytes(data)
    return mutate


def _header(header: object) -> bytes:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(raw)) + raw


def _index(weight_map: object) -> Mutation:
    def mutate(_target: Path, draft: Path) -> None:
        (draft / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return mutate


def _fifo_shard(_target: Path, draft: Path) -> None:
    os.mkfifo(draft / "fc.safetensors")
    index = {"weight_map": {"fc.weight": "fc.safetensors"}}
    (draft / "model.safetensors.index.json").write_text(json.dumps(index))


NESTED = b"[" * 100_000 + b"]" * 100_000
HUGE_INT = b'{"hidden_size": ' + b"9" * 5000 + b', "num_hidden_layers": 36}'

# (mutation, exit code, causes it may be reported under)
BAD: dict[str, tuple[Mutation, int, set[str]]] = {
    "target config not UTF-8": (_raw_config("target", b'{"hidden_size": "\xff\xfe"}'), 1, {"bad_config"}),
    "draft config nested 100k deep": (_raw_config("draft", NESTED), 1, {"bad_config"}),
    "target config 5000-digit integer": (_raw_config("target", HUGE_INT), 1, {"bad_config"}),
    "target config empty": (_raw_config("target", b""), 1, {"bad_config"}),
    "draft config null": (_raw_config("draft", b"null"), 1, {"bad_config"}),
    "draft config NaN block": (_raw_config("draft", b'{"hidden_size": 4096, "block_size": NaN}'), 1,
                               {"bad_config"}),
    "hidden_size 10**30": (_set("target", "hidden_size", 10**30), 1, {"bad_config"}),
    "hidden_size float": (_set("target", "hidden_size", 4096.0), 1, {"bad_config"}),
    "hidden_size negative": (_set("target", "hidden_size", -4096), 1, {"bad_config"}),
    "hidden_size true": (_set("target", "hidden_size", True), 1, {"bad_config"}),
    "num_hidden_layers 10**18": (_set("target", "num_hidden_layers", 10**18), 1,
                                 {"bad_config", "layer_ids_out_of_range"}),
    "block_size 0": (_set("draft", "block_size", 0), 1, {"bad_config"}),
    "block_size string": (_set("draft", "block_size", "16"), 1, {"bad_config"}),
    "dflash_config a list": (_set("draft", "dflash_config", [1, 9]), 1, {"bad_config"}),
    "layer ids repeated": (_set("draft", "target_layer_ids", [1, 1, 17, 25, 33], dflash=True), 1,
                           {"hidden_width_mismatch"}),
    "layer ids unsorted": (_set("draft", "target_layer_ids", [9, 1, 17, 25, 33], dflash=True), 1,
                           {"layer_ids_unsorted"}),
    "layer ids negative": (_set("draft", "target_layer_ids", [-1, 9, 17, 25, 33], dflash=True), 1,
                           {"layer_ids_out_of_range"}),
    "layer ids 100k long": (_set("draft", "target_layer_ids", list(range(100_000)), dflash=True), 1,
                            {"layer_ids_out_of_range"}),
    "layer ids floats": (_set("draft", "target_layer_ids", [1.0, 9, 17, 25, 33], dflash=True), 1,
                         {"bad_config"}),
    "target config a FIFO": (_replace("target", "config.json", "fifo"), 1, {"bad_config"}),
    "draft config -> /dev/zero": (_replace("draft", "config.json", "zero"), 1, {"bad_config"}),
    "draft config a directory": (_replace("draft", "config.json", "dir"), 1, {"bad_config"}),
    "target config 40 MB": (_replace("target", "config.json", "giant"), 1, {"bad_config"}),
    "weights a FIFO": (_replace("draft", "model.safetensors", "fifo"), 1, {"bad_safetensors"}),
    "weights -> /dev/zero": (_replace("draft", "model.safetensors", "zero"), 1, {"bad_safetensors"}),
    "weights -> /dev/urandom": (_replace("draft", "model.safetensors", "urandom"), 1, {"bad_safetensors"}),
    "weights dangling link": (_replace("draft", "model.safetensors", "dangling"), 1, {"bad_safetensors"}),
    "weights sparse 40 MB": (_replace("draft", "model.safetensors", "giant"), 1, {"bad_safetensors"}),
    "header length beyond file": (_safetensors(struct.pack("<Q", 10_000) + b"{}"), 1, {"bad_safetensors"}),
    "header nested 100k deep": (_safetensors(_header(NESTED)), 1, {"bad_safetensors"}),
    "header not UTF-8": (_safetensors(_header(b'{"\xff": 1}')), 1, {"bad_safetensors"}),
    "header 5000-digit offsets": (_safetensors(_header(
        b'{"fc.weight": {"dtype": "BF16", "shape": [4096, 20480], "data_offsets": [0, '
        + b"9" * 5000 + b"]}}")),
        1, {"bad_safetensors"}),
    "fc shape huge ints": (_safetensors(_header(
        {"fc.weight": {"dtype": "BF16", "shape": [10**40, 10**40], "data_offsets": [0, 2 * 10**80]}})),
        1, {"hidden_width_mismatch", "fc_width_mismatch", "bad_safetensors"}),
    "fc shape strings": (_safetensors(_header(
        {"fc.weight": {"dtype": "BF16", "shape": ["4096", "20480"], "data_offsets": [0, 1]}})), 1,
        {"bad_safetensors"}),
    "index points outside": (_index({"fc.weight": "../../../../etc/passwd"}), 1, {"bad_safetensors"}),
    "index points absolute": (_index({"fc.weight": "/etc/passwd"}), 1, {"bad_safetensors"}),
    "index maps to an object": (_index({"fc.weight": {"file": "a"}}), 1, {"bad_safetensors"}),
    "index names a FIFO shard": (_fifo_shard, 1, {"bad_safetensors"}),
    "index nested": (_replace("draft", "model.safetensors.index.json", "zero"), 1, {"bad_safetensors"}),
    "width 4096 x 4 vs 5": (_set("draft", "target_layer_ids", [1, 9, 17, 25], dflash=True), 1,
                            {"hidden_width_mismatch"}),
}

# Harmless variations: the pair still agrees and must pass.
GOOD: dict[str, Mutation] = {
    "unknown extra keys": _set("draft", "x_unknown", {"nested": [1, 2, {"deep": None}]}),
    "unicode elsewhere": _set("target", "_name_or_path", "модель/模型/🚀"),
    "ids given at top level": _set("draft", "target_layer_ids", [1, 9, 17, 25, 33]),
    "a stray .safetensors file too": lambda _t, d: write_header_only_safetensors(
        d / "optimizer.safetensors", {"x": ("BF16", [2])}),
}


def _is_weights_defect(name: str) -> bool:
    return any(w in name for w in ("weights", "header", "fc shape"))


def _case(seed: int, root: Path) -> tuple[Path, Path, list[str], int | None, set[str]]:
    """Seed i < len(BAD) plants defect i (plus, one time in three, a random second one); the seeds
    after that plant the harmless variations, then random pairs of defects."""
    rng = random.Random(seed)
    target, draft = write_pair(root, "qwen3-8b", sharded=rng.random() < 0.25)
    bad = sorted(BAD)
    if len(bad) <= seed < len(bad) + len(GOOD):
        name = sorted(GOOD)[seed - len(bad)]
        GOOD[name](target, draft)
        return target, draft, [name], EXIT_PASS, set()
    names = [bad[seed]] if seed < len(bad) else [rng.choice(bad)]
    if rng.random() < 0.35:
        names.append(rng.choice([n for n in bad if n not in names]))
    if sum("index" in n or _is_weights_defect(n) for n in names) > 1:
        names = names[:1]  # the weights defects exclude each other (sharded or single file)
    exit_codes, causes = set(), set()
    for name in names:
        mutate, code, allowed = BAD[name]
        if "index" in name and not (draft / "model.safetensors.index.json").exists():
            (draft / "model.safetensors").unlink()
        if _is_weights_defect(name) and (draft / "model.safetensors.index.json").exists():
            (draft / "model.safetensors.index.json").unlink()
            for shard in draft.glob("model-*.safetensors"):
                shard.unlink()
            write_header_only_safetensors(draft / "model.safetensors", {"fc.weight": ("BF16", [4096, 20480])})
        mutate(target, draft)
        exit_codes.add(code)
        causes |= allowed
    return target, draft, names, None if len(exit_codes) > 1 else exit_codes.pop(), causes


def _assert_outcome(report, names: list[str], exit_code: int | None, causes: set[str], took: float) -> None:
    assert took < 5, f"{names}: {took:.1f} s"
    if exit_code == EXIT_PASS:
        assert report.ok and report.exit_code == EXIT_PASS, (names, report.message)
        return
    assert not report.ok, f"{names}: a broken pair passed: {report.message}"
    assert report.exit_code in ((exit_code,) if exit_code else (EXIT_FAILED, EXIT_BAD_INPUT)), (names, report)
    assert report.cause in causes, (names, report.cause, report.message)
    assert "\n" not in report.message and len(report.message) < 2000, (names, report.message)
    json.dumps(report.to_dict(), allow_nan=False)


@pytest.mark.parametrize("seed", SEEDS)
def test_static_probe_on_a_hostile_directory(seed: int, tmp_path: Path) -> None:
    target, draft, names, exit_code, causes = _case(seed, tmp_path)
    started = time.monotonic()
    report = static_probe(str(target), str(draft))
    _assert_outcome(report, names, exit_code, causes, time.monotonic() - started)


@pytest.mark.parametrize("seed", CLI_SEEDS)
def test_cli_says_it_in_one_report_with_the_documented_exit_code(seed: int, tmp_path: Path) -> None:
    target, draft, names, exit_code, _ = _case(seed, tmp_path)
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "ddtree_runtime", "probe", "static", "--model-path", str(target),
           "--draft-model-path", str(draft), "--json", "--write-report", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert "Traceback" not in res.stdout + res.stderr and res.stderr == "", (names, res.stderr)
    doc = json.loads(res.stdout)
    assert doc == json.loads(out.read_text())  # strict JSON, written whole
    assert res.returncode == doc["exit_code"] and (res.returncode == EXIT_PASS) == doc["ok"]
    if exit_code is not None:
        assert res.returncode == exit_code, (names, doc["message"])
    assert not list(tmp_path.glob(".report.json.*"))  # no temp file left behind
    # `ddtree contract check` reads the same files: the same verdict, one JSON line, no traceback
    cmd = [sys.executable, "-m", "ddtree_runtime", "contract", "check", "--model-path", str(target),
           "--draft-model-path", str(draft), "--json"]
    check = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert "Traceback" not in check.stderr and check.stdout.count("\n") == 1, check.stderr
    assert json.loads(check.stdout)["ok"] == doc["ok"] and check.returncode == (0 if doc["ok"] else 1)


# ---------------------------------------------------------------------------- named regressions


def test_repeated_layer_id_is_the_width_mismatch_sglang_would_hit(tmp_path: Path) -> None:
    target, draft = write_pair(tmp_path, "qwen3.6-27b",
                               draft_overrides={"dflash_config": {"target_layer_ids": [1, 1, 31, 46, 61]}})
    report = static_probe(str(target), str(draft))
    assert (report.ok, report.exit_code, report.cause) == (False, EXIT_FAILED, "hidden_width_mismatch")
    assert "[N, 20480]" in report.message and "[N, 25600]" in report.message
    with pytest.raises(ContractError) as err:
        load_contract(target, draft)
    assert err.value.cause == "layer_ids_repeated"


def test_unsorted_layer_ids_are_refused_because_sglang_captures_in_layer_order(tmp_path: Path) -> None:
    target, draft = write_pair(tmp_path, "qwen3.6-27b",
                               draft_overrides={"dflash_config": {"target_layer_ids": [16, 1, 31, 46, 61]}})
    report = static_probe(str(target), str(draft))
    assert (report.ok, report.cause) == (False, "layer_ids_unsorted")
    assert "[1, 16, 31, 46, 61]" in report.message and "layer order" in report.message


def test_unreadable_directory_is_bad_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target, draft = write_pair(tmp_path, "qwen3-8b")
    real_stat = os.stat

    def denied(path, *args, **kwargs):
        if str(path).startswith(str(draft)):
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", denied)
    report = static_probe(str(target), str(draft))
    assert (report.exit_code, report.cause) == (EXIT_BAD_INPUT, "bad_input")
    assert "permission denied" in report.message


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the probe as another user")
def test_unreadable_directory_as_an_unprivileged_user(tmp_path: Path) -> None:
    target, draft = write_pair(tmp_path, "qwen3-8b")
    tmp_path.chmod(0o755)
    draft.chmod(0o700)  # root's: nobody cannot search it
    cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
           "ddtree_runtime", "probe", "static", "--model-path", str(target), "--draft-model-path", str(draft)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd="/")
    if "No module named" in res.stderr or res.returncode in (126, 127):
        pytest.skip(f"this checkout is not readable by nobody: {res.stderr[-200:]}")
    assert res.returncode == EXIT_BAD_INPUT, res.stdout + res.stderr
    assert "permission denied" in res.stdout and "Traceback" not in res.stderr
    check = subprocess.run([*cmd[:7], "contract", "check", *cmd[9:]], capture_output=True, text=True,
                           timeout=30, cwd="/")
    assert check.returncode == 1 and "permission denied" in check.stderr and "Traceback" not in check.stderr
