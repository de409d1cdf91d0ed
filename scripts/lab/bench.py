#!/usr/bin/env python3
"""Lab timings as JSON lines (medians over --repeat runs): host up (boot to systemd running + ssh),
down, a venv install of torch + ddtree-runtime from the wheelhouse inside a host, and with --cold the
debootstrap of a fresh rootfs (into a temporary cache, so running labs keep theirs).

    sudo .venv/bin/python scripts/lab/bench.py --repeat 3 [--cold]
Needs `ddtree lab wheelhouse` first for the install figure. Uses its own lab name ("bench").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from ddtree_runtime.ops.labhosts import hosts as labhosts
from ddtree_runtime.ops.labhosts import rootfs as lab_rootfs
from ddtree_runtime.ops.labhosts.spec import Lab

NAME = "bench"
INSTALL = (
    "rm -rf /opt/bench-venv && python3 -m venv /opt/bench-venv && /opt/bench-venv/bin/pip install -q "
    "--no-index --find-links /srv/wheelhouse torch==2.13.0 ddtree-runtime && rm -rf /opt/bench-venv"
)


def timed(fn) -> float:
    started = time.monotonic()
    fn()
    return time.monotonic() - started


def emit(bench: str, runs: list[float], **extra) -> None:
    line = {
        "bench": bench,
        "median_s": round(statistics.median(runs), 2),
        "runs_s": [round(r, 2) for r in runs],
    }
    print(json.dumps({**line, **extra}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="also time a fresh debootstrap")
    args = parser.parse_args()
    quiet = lambda _msg: None  # noqa: E731
    load = os.getloadavg()[0]

    if args.cold:
        with tempfile.TemporaryDirectory(prefix="ddtree-lab-cache-") as cache:
            os.environ["DDTREE_LAB_CACHE"] = cache
            run = timed(lambda: lab_rootfs.ensure_rootfs(quiet))
            size = subprocess.run(["du", "-sm", cache], capture_output=True, text=True).stdout.split()[0]
            del os.environ["DDTREE_LAB_CACHE"]
        emit("rootfs_debootstrap", [run], size_mib=int(size), load1=load)

    ups, downs, installs = [], [], []
    labhosts.down(NAME, progress=quiet)
    for _ in range(args.repeat):
        ups.append(timed(lambda: labhosts.up(NAME, 1, progress=quiet)))
        if any(labhosts.wheelhouse_dir().glob("torch-*.whl")):
            lab = Lab(NAME, 1)
            started = time.monotonic()
            proc = labhosts.ssh_run(lab, lab.hosts[0], INSTALL, timeout=900)
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                return 1
            installs.append(time.monotonic() - started)
        downs.append(timed(lambda: labhosts.down(NAME, progress=quiet)))
    emit("lab_up_1_host", ups, note="cached rootfs; overlay, netns, boot to systemd running, ssh", load1=load)
    emit("lab_down_1_host", downs, load1=load)
    if installs:
        emit("host_venv_install_torch_and_ddtree_runtime", installs, load1=load)
    return 0


if __name__ == "__main__":
    if shutil.which("systemd-nspawn") is None or os.geteuid() != 0:
        sys.exit("needs root and systemd-nspawn (scripts/lab/prereqs.sh)")
    sys.exit(main())
