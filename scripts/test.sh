#!/usr/bin/env bash
# README's test command runs this (through `make test`). Fails when any test fails.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"

ruff check .
# --- lab hosts (issue 7): tests/lab boot systemd-nspawn machines; install their Debian packages when
# missing (systemd-container, debootstrap, ...; one apt-get update). Without root the lab tests skip.
if [ "$(id -u)" -eq 0 ]; then
    bash scripts/lab/prereqs.sh
fi
# --- end lab hosts
# Without CUDA every Triton kernel runs in Triton's interpreter. The flag must be set before triton
# is first imported anywhere in the pytest process (triton.jit reads it at decoration time).
if ! python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    export TRITON_INTERPRET=1
fi
# The slowest tests in every log: what the CI budget (40 min on 2 cores) is spent on (docs/ci-time.md).
# Suites run side by side in DDTREE_TEST_WORKERS pytest-xdist workers (each with a lab of its own);
# a group (a module, or the modules sharing one lab world) runs whole on one worker, longest first
# (tests/conftest.py). DDTREE_TEST_WORKERS=0 runs everything in this one process, as before.
python -m pytest tests --durations=25 -n "${DDTREE_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder "$@"
