#!/usr/bin/env bash
# Sets up everything the tests need, then lints, type-checks and runs the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
mypy
python -m pytest -q "$@"
