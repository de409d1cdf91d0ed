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
# The slowest tests in every log: what the CI budget (45 min on 2 cores) is spent on.
python -m pytest tests --durations=25 "$@"
