"""Build the ddtree-runtime wheel from a checkout and name the release by its content.

Runs on the controller. The checkout's package sources are copied to a scratch directory (the
checkout stays clean, concurrent builds do not share a build/ folder) and built with
SOURCE_DATE_EPOCH fixed. The release id hashes the wheel's RECORD (a sha256 per file, so the
files' content and nothing else) plus the pinned requirements: the same checkout and pins give
the same id, which is what makes a redeploy a no-op. ``--extra-project DIR`` (the lab's CPU layer,
never a production host's) builds another project the same way into the same release: its RECORD
joins the id. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# What the wheel is built from; anything else in the checkout does not reach a host.
_SOURCES = ("pyproject.toml", "README.md", "LICENSE", "setup.cfg", "setup.py", "MANIFEST.in")
_PACKAGE = "ddtree_runtime"


def copy_sources(checkout: Path, dest: Path) -> None:
    if not (checkout / "pyproject.toml").is_file():
        raise SystemExit(f"{checkout} has no pyproject.toml: point ddtree_runtime_source_dir at the checkout")
    for name in _SOURCES:
        if (checkout / name).is_file():
            shutil.copy2(checkout / name, dest / name)
    shutil.copytree(
        checkout / _PACKAGE,
        dest / _PACKAGE,
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"),
    )


def build_wheel(source: Path, out: Path, name: str = _PACKAGE) -> Path:
    env = {**os.environ, "SOURCE_DATE_EPOCH": "315532800", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
           str(source)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"building the wheel failed:\n{result.stdout}\n{result.stderr}")
    wheels = sorted(out.glob(f"{name}-*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"expected one {name} wheel in {out}, found {[w.name for w in wheels]}")
    return wheels[0]


def _record(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD")))


def release_id(wheel: Path, pins: list[str], extra_wheels: tuple[Path, ...] = ()) -> str:
    digest = hashlib.sha256(_record(wheel))
    for extra in sorted(extra_wheels, key=lambda w: w.name):
        digest.update(b"\n" + extra.name.encode() + b"\n" + _record(extra))
    for pin in sorted(pins):
        digest.update(b"\n" + pin.encode())
    return digest.hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True, help="the checkout")
    parser.add_argument("--out", type=Path, required=True, help="wheels go to OUT/<release_id>/")
    parser.add_argument("--pin", action="append", default=[], help="a pinned requirement (repeat)")
    parser.add_argument("--extra-project", action="append", default=[], type=Path,
                        help="another project folder built into the same release (repeat)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="ddtree-build-") as scratch:
        src, dist = Path(scratch, "src"), Path(scratch, "dist")
        src.mkdir()
        copy_sources(args.source.resolve(), src)
        wheel = build_wheel(src, dist)
        extras = tuple(build_extra(project.resolve(), Path(scratch, f"extra{i}"))
                       for i, project in enumerate(args.extra_project))
        rid = release_id(wheel, args.pin, extras)
        target_dir = args.out / rid
        target_dir.mkdir(parents=True, exist_ok=True)
        targets = [keep(w, target_dir) for w in (wheel, *extras)]
    main_wheel, *extra_wheels = targets
    print(json.dumps({"release_id": rid, **describe(main_wheel), "pins": sorted(args.pin),
                      "extra_wheels": [describe(w) for w in extra_wheels]}))
    return 0


def build_extra(project: Path, scratch: Path) -> Path:
    if not (project / "pyproject.toml").is_file():
        raise SystemExit(f"--extra-project {project}: no pyproject.toml there")
    src = scratch / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    shutil.copytree(project, src, ignore=skip)
    name = _project_name(project / "pyproject.toml")
    return build_wheel(src, scratch / "dist", name.replace("-", "_"))


def _project_name(pyproject: Path) -> str:
    import tomllib

    return tomllib.loads(pyproject.read_text())["project"]["name"]


def keep(wheel: Path, target_dir: Path) -> Path:
    target = target_dir / wheel.name
    if not target.exists():  # same id = same content: keep the first copy
        tmp = target_dir / (wheel.name + ".tmp")
        shutil.copy2(wheel, tmp)
        os.replace(tmp, target)
    return target


def describe(wheel: Path) -> dict[str, str]:
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return {"wheel": str(wheel.resolve()), "wheel_name": wheel.name, "wheel_sha256": sha}


if __name__ == "__main__":
    sys.exit(main())
