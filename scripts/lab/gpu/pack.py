"""Pack what one `device` call carries to the H200 for the GPU lab into .gpulab/ (git-ignored).

    .venv/bin/python scripts/lab/gpu/pack.py [--baseline REF]

then, through the device tool: `run` with carry [".gpulab"] and the command
`bash scripts/lab/gpu/device.sh CASE ...` (docs/sglang-gpu-lab.md).

What goes in (the device has torch 2.11, Triton 3.6, Python 3.12 and nvcc, no network, no SGLang):
- sglang-py.tar.xz: SGLang 0.5.23's Python files as the pinned wheel installed them in this venv (with
  its dist-info), without compiled extensions, caches, tests, benchmarks or multimodal generation;
- wheels/: the py3.12 wheels the device lacks (scripts/lab/sglang-gpu-lab/device-wheels.txt, fetched
  once into .gpulab/cache/), this checkout's ddtree-runtime, the lab layers' base
  (ddtree-sglang-lab-base, the machinery the GPU layer runs on) and the CPU and GPU lab layers;
- models.tar.xz: the lab's dense and hybrid pairs (`ddtree lab make-models`, made once, deterministic);
- baseline/ddtree_runtime: with --baseline REF, the plugin as of REF (the device puts it first on
  PYTHONPATH for the `-baseline` servers of a case);
- jit-cache.tar.xz, when a previous device run brought one back: SGLang's run-time compiled kernels and
  Triton's cache (compiling them on a fresh machine takes minutes).
The call carries at most 64 MiB with the working tree: the pack refuses to go over 60.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
OUT = REPO / ".gpulab"
CACHE = REPO / ".gpulab-cache"  # downloads, models, builds: reused, never carried
WHEEL_LIST = REPO / "scripts/lab/sglang-gpu-lab/device-wheels.txt"
LAYERS = (
    REPO / "scripts/lab/sglang-lab-base",
    REPO / "scripts/lab/sglang-cpu-lab",
    REPO / "scripts/lab/sglang-gpu-lab",
)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64",
)
SGLANG_SKIP = ("sglang/test/", "sglang/benchmark/", "sglang/multimodal_gen/", "__pycache__/")
LIMIT_MIB = 60


def log(msg: str) -> None:
    print(f"pack: {msg}", file=sys.stderr, flush=True)


def run(*argv: str, cwd: Path | None = None) -> None:
    subprocess.run(argv, check=True, cwd=cwd)


def device_wheels() -> list[Path]:
    dest = CACHE / "device-wheels"
    wanted = [
        line.strip()
        for line in WHEEL_LIST.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    have = (
        {p.name.split("-")[0].lower().replace("_", "-") for p in dest.glob("*.whl")}
        if dest.is_dir()
        else set()
    )
    missing = [w for w in wanted if w.split("==")[0].lower().replace("_", "-") not in have]
    if missing:
        log(f"downloading {len(missing)} py3.12 wheels")
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        run(
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            *platforms,
            "-d",
            str(dest),
            *missing,
        )
    return sorted(dest.glob("*.whl"))


def project_wheels(dest: Path) -> None:
    for source in (REPO, *LAYERS):
        build = CACHE / "build" / source.name
        shutil.rmtree(build, ignore_errors=True)
        shutil.copytree(
            source,
            build,
            ignore=shutil.ignore_patterns(
                ".git", ".venv*", ".lab", ".gpulab", "*.egg-info", "__pycache__", "build", "dist", "tests"
            ),
        )
        run(
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dest),
            str(build),
        )


def sglang_tarball(path: Path) -> None:
    site = Path(sysconfig.get_paths()["purelib"])
    dist = next(site.glob("sglang-*.dist-info"))
    with tarfile.open(path, "w:xz", preset=6) as tar:
        for root in (site / "sglang", dist):
            for file in sorted(root.rglob("*")):
                rel = file.relative_to(site).as_posix()
                if (
                    file.is_dir()
                    or file.suffix in (".so", ".pyc")
                    or any(s in rel + "/" for s in SGLANG_SKIP)
                ):
                    continue
                tar.add(file, arcname=rel, recursive=False)


def models_tarball(path: Path) -> None:
    models = CACHE / "models"
    for kind in ("dense", "hybrid"):
        if not (models / kind / "draft" / "model.safetensors").is_file():
            log(f"making the lab {kind} pair")
            run(
                sys.executable,
                "-m",
                "ddtree_runtime",
                "lab",
                "make-models",
                str(models / kind),
                "--kind",
                kind,
            )
    with tarfile.open(path, "w:xz") as tar:
        for kind in ("dense", "hybrid"):
            for name in ("target", "draft"):
                tar.add(models / kind / name, arcname=f"models/{kind}/{name}")


def baseline(ref: str, dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", ref, "ddtree_runtime"], check=True, capture_output=True
    )
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    (dest / "REF").write_text(
        subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", ref], check=True, capture_output=True, text=True
        ).stdout
    )


def size_mib(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", metavar="REF", help="also carry the plugin as of this git ref")
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    wheels = OUT / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir()
    for whl in device_wheels():
        shutil.copy2(whl, wheels / whl.name)
    project_wheels(wheels)
    sglang_tarball(OUT / "sglang-py.tar.xz")
    models_tarball(OUT / "models.tar.xz")
    if args.baseline:
        baseline(args.baseline, OUT / "baseline")
    else:
        shutil.rmtree(OUT / "baseline", ignore_errors=True)
    carried = list(OUT.iterdir())
    manifest = {p.name: round(size_mib(p), 2) for p in sorted(carried)}
    tree = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    manifest["working_tree"] = round(
        sum((REPO / f).stat().st_size for f in tree if (REPO / f).is_file()) / 2**20, 2
    )
    total = sum(manifest.values())
    (OUT / "MANIFEST.json").write_text(json.dumps({"mib": manifest, "total_mib": round(total, 1)}, indent=1))
    print(json.dumps({"pack": str(OUT), "total_mib": round(total, 1), **manifest}))
    if total > LIMIT_MIB:
        log(f"{total:.1f} MiB is over the {LIMIT_MIB} MiB a call can carry with room to spare")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
