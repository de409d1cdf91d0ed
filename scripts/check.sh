#!/usr/bin/env bash
# The fast loop (`make check`): lint plus the tests that start no process, in well under a minute on
# 2 cores. README's `make test` runs everything; docs/testing.md says which is which.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"

ruff check .
python -m pytest tests -m "not slow" -q -p no:cacheprovider "$@"
