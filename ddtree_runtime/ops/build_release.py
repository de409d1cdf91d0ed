"""Build the ddtree-runtime wheel from a checkout and name the release by its content.

Runs on the controller: the runtime role runs ``python -m ddtree_runtime.ops.build_release`` with the
playbook's interpreter in ``ddtree_controller_env``, as every controller task runs ours. Standard library
only. The checkout's package sources are copied to a scratch directory (the
checkout stays clean, concurrent builds do not share a build/ folder) and built with
SOURCE_DATE_EPOCH fixed. The release id hashes the wheel's RECORD (a sha256 per file, so the
files' content and nothing else) plus the pinned requirements: the same checkout and pins give
the same id, which is what makes a redeploy a no-op. ``--extra-project DIR`` (the lab's CPU layer,
never a production host's) builds another project the same way into the same release: its RECORD
joins the id. Prints one JSON object.

A build is remembered under OUT/.built/ by a digest of everything it reads (the files it copies,
the pins, this script, the Python and setuptools versions): a play that deploys sources already
built prints the earlier result, after checking its wheels are still there unchanged, instead of
building again (3-5 s of the controller's CPU per play).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import importlib.metadata
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
_SKIP = ("__pycache__", "*.pyc", "*.egg-info")
_EXTRA_SKIP = (*_SKIP, "build")


def _tree_files(root: Path, skip: tuple[str, ...]) -> list[Path]:
    """The files under root whose names and folders match none of skip, relative, sorted."""
    def kept(name: str) -> bool:
        return not any(fnmatch.fnmatch(name, pattern) for pattern in skip)

    out = []
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if kept(d)]
        out += [Path(here, f).relative_to(root) for f in files if kept(f)]
    return sorted(out)


def source_files(checkout: Path) -> list[Path]:
    """What the wheel is built from, relative to the checkout."""
    if not (checkout / "pyproject.toml").is_file():
        raise SystemExit(f"{checkout} has no pyproject.toml: point ddtree_runtime_source_dir at the checkout")
    top = [Path(name) for name in _SOURCES if (checkout / name).is_file()]
    return top + [_PACKAGE / f for f in _tree_files(checkout / _PACKAGE, _SKIP)]


def copy_files(root: Path, files: list[Path], dest: Path) -> None:
    """Copy the listed files (relative to root): the same list the build key hashes."""
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, dest / rel)


def copy_sources(checkout: Path, dest: Path) -> None:
    copy_files(checkout, source_files(checkout), dest)


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

    key = build_key(args.source.resolve(), [p.resolve() for p in args.extra_project], args.pin)
    remembered = args.out / ".built" / f"{key}.json"
    if (earlier := recall(remembered)) is not None:
        print(json.dumps(earlier))
        return 0
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
    result = {"release_id": rid, **describe(main_wheel), "pins": sorted(args.pin),
              "extra_wheels": [describe(w) for w in extra_wheels]}
    remember(remembered, result)
    print(json.dumps(result))
    return 0


def build_key(checkout: Path, extra_projects: list[Path], pins: list[str]) -> str:
    """A digest of everything a build reads: same key, same wheels (SOURCE_DATE_EPOCH is fixed)."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    tools = [sys.version, *(_version(dist) for dist in ("setuptools", "wheel", "pip"))]
    digest.update("\n".join(tools).encode())
    trees = [(checkout, source_files(checkout))]
    trees += [(p, _tree_files(p, _EXTRA_SKIP)) for p in extra_projects]
    for root, files in trees:
        digest.update(b"\0tree\0")
        for rel in files:
            digest.update(f"\0{rel}\0".encode() + (root / rel).read_bytes())
    for pin in sorted(pins):
        digest.update(b"\0pin\0" + pin.encode())
    return digest.hexdigest()


def _version(dist: str) -> str:
    try:
        return f"{dist} {importlib.metadata.version(dist)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{dist} -"


def recall(remembered: Path) -> dict | None:
    """An earlier build's result, if each of its wheels is still there with the same sha256."""
    try:
        result = json.loads(remembered.read_text())
        for wheel in (result, *result["extra_wheels"]):
            if hashlib.sha256(Path(wheel["wheel"]).read_bytes()).hexdigest() != wheel["wheel_sha256"]:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return result


def remember(remembered: Path, result: dict) -> None:
    remembered.parent.mkdir(parents=True, exist_ok=True)
    tmp = remembered.with_name(f"{remembered.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, remembered)


def build_extra(project: Path, scratch: Path) -> Path:
    if not (project / "pyproject.toml").is_file():
        raise SystemExit(f"--extra-project {project}: no pyproject.toml there")
    src = scratch / "src"
    copy_files(project, _tree_files(project, _EXTRA_SKIP), src)
    name = _project_name(project / "pyproject.toml")
    return build_wheel(src, scratch / "dist", name.replace("-", "_"))


def _project_name(pyproject: Path) -> str:
    import tomllib

    return tomllib.loads(pyproject.read_text())["project"]["name"]


def keep(wheel: Path, target_dir: Path) -> Path:
    target = target_dir / wheel.name
    # Same id = same content: keep the first copy, unless it no longer is what was built.
    if not target.exists() or target.read_bytes() != wheel.read_bytes():
        tmp = target_dir / f"{wheel.name}.{os.getpid()}.tmp"  # builds for several hosts may run at once
        shutil.copy2(wheel, tmp)
        os.replace(tmp, target)
    return target


def describe(wheel: Path) -> dict[str, str]:
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return {"wheel": str(wheel.resolve()), "wheel_name": wheel.name, "wheel_sha256": sha}


if __name__ == "__main__":
    sys.exit(main())
