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
python -m pytest tests "$@"
