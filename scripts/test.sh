#!/usr/bin/env bash
# README's test command runs this (through `make test`). Fails when any test fails.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"

ruff check .
python -m pytest tests "$@"
