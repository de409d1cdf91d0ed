"""`ddtree lab wheelhouse`: the folder lab hosts install from (they have no route to any index).

Filled from requirements/lab-wheelhouse.txt (pip's own resolver and cache do the work), plus the
project's wheel built from the checkout. The CPU torch wheel comes from the machine's wheel folder:
a CUDA torch (several GB) in the wheelhouse is refused.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ddtree_runtime.ops.labhosts.spec import repo_root

REQUIREMENTS = Path("requirements/lab-wheelhouse.txt")
NO_DEPS_MARK = "# no-deps"
TORCH_PIN = "torch==2.13.0"
STAMP = ".requirements.sha256"
# Where the machine keeps the CPU torch wheel; pip's own config names it too, this makes it explicit.
CPU_WHEELS = Path(os.environ.get("DDTREE_LAB_FIND_LINKS", "/opt/wheels"))

Progress = Callable[[str], None]


class WheelhouseError(RuntimeError):
    """The wheelhouse could not be filled; the message names the failing step."""


def split_requirements(path: Path) -> tuple[list[str], list[str]]:
    """(lines fetched with dependencies, requirements fetched without), includes made absolute."""
    with_deps, no_deps = [], []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith(NO_DEPS_MARK):
            no_deps.append(line.removesuffix(NO_DEPS_MARK).strip())
        elif line.startswith(("-r ", "-c ")):
            flag, target = line.split(None, 1)
            with_deps.append(f"{flag} {(path.parent / target).resolve()}")
        else:
            with_deps.append(line)
    return with_deps, no_deps


def fill(dest: Path, *, build_project: bool = True, progress: Progress) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    requirements = repo_root() / REQUIREMENTS
    with open(dest.parent / ".wheelhouse.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one filler at a time per checkout
        digest = _requirements_digest(requirements)
        stamp = dest / STAMP
        if stamp.exists() and stamp.read_text().strip() == digest:
            progress(f"wheelhouse: requirements unchanged, reusing {dest}")
        else:
            _fetch(requirements, dest, progress)
            stamp.write_text(digest + "\n")
        _check_torch(dest)
        if build_project:
            _build_project(dest, progress)
    total = sum(p.stat().st_size for p in dest.glob("*.whl"))
    progress(f"wheelhouse: {len(list(dest.glob('*.whl')))} wheels, {total / 2**20:.0f} MiB in {dest}")


def _requirements_digest(requirements: Path) -> str:
    h = hashlib.sha256()
    with_deps, _ = split_requirements(requirements)
    for path in [
        requirements,
        *(Path(line.split(None, 1)[1]) for line in with_deps if line.startswith("-r ")),
    ]:
        h.update(path.read_bytes())
    return h.hexdigest()


def _pip(*args: str, what: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-12:])
        raise WheelhouseError(f"{what} failed (`{' '.join(cmd)}`):\n{tail}")


def _fetch(requirements: Path, dest: Path, progress: Progress) -> None:
    with_deps, no_deps = split_requirements(requirements)
    started = time.monotonic()
    progress(f"wheelhouse: pip wheel -r {REQUIREMENTS} (with dependencies) into {dest}")
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as flat:
        flat.write("\n".join(with_deps) + "\n")
        flat.flush()
        # `pip wheel` rather than `pip download`: a dependency published only as an sdist is built here,
        # since the hosts install with --no-index and may lack build tools.
        links = ["--find-links", str(CPU_WHEELS)] if CPU_WHEELS.is_dir() else []
        _pip("wheel", "--quiet", *links, "--wheel-dir", str(dest), "-r", flat.name, what="pip wheel (deps)")
    if no_deps:
        progress(f"wheelhouse: pip wheel --no-deps {' '.join(no_deps)}")
        _pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(dest), *no_deps, what="pip wheel --no-deps")
    progress(f"wheelhouse: fetched in {time.monotonic() - started:.0f} s")


def _check_torch(dest: Path) -> None:
    torch = sorted(p.name for p in dest.glob("torch-*.whl"))
    cuda = sorted(p.name for p in dest.glob("nvidia_*.whl"))
    if cuda or (torch and not all("+cpu" in name for name in torch)):
        raise WheelhouseError(
            f"the wheelhouse holds a CUDA torch stack ({', '.join(torch + cuda)}): lab hosts take the CPU "
            f"wheel; keep {TORCH_PIN} pinned in the requirements and the CPU wheel in pip's find-links "
            "(/opt/wheels), then delete .lab/wheelhouse/ and run `ddtree lab wheelhouse` again"
        )
    if not torch:
        raise WheelhouseError(f"no torch wheel in {dest}: {REQUIREMENTS} must pin {TORCH_PIN}")


def _build_project(dest: Path, progress: Progress) -> None:
    """Build ddtree-runtime from the checkout; replace the previous build atomically."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ddtree-wheel-") as tmp:
        # A copy of the tracked sources: building in place would leave build/ and egg-info in the checkout.
        src = Path(tmp) / "src"
        files = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard",
             "ddtree_runtime", "pyproject.toml", "README.md"],
            cwd=repo_root(), capture_output=True, check=True,
        ).stdout.decode().split("\0")  # fmt: skip
        for rel in filter(None, files):
            target = src / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if (repo_root() / rel).is_file():
                shutil.copy2(repo_root() / rel, target)
        out = Path(tmp) / "out"
        _pip("wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", str(out), str(src),
             what="building the ddtree-runtime wheel")  # fmt: skip
        (wheel,) = out.glob("ddtree_runtime-*.whl")
        # Copied in under a name pip ignores, then renamed over the old one: a lab host installing from
        # the wheelhouse meanwhile (another test worker's lab) never finds the wheel missing or half written.
        partial = dest / f".{wheel.name}.{os.getpid()}.partial"
        shutil.copy2(wheel, partial)
        os.replace(partial, dest / wheel.name)
        for old in dest.glob("ddtree_runtime-*.whl"):
            if old.name != wheel.name:
                old.unlink()
    progress(f"wheelhouse: built {wheel.name} in {time.monotonic() - started:.0f} s")
