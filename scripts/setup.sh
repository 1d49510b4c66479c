#!/usr/bin/env bash
# Sets up .venv with everything the engine, the demo and the tests need. Idempotent.
# torch is installed first and pinned: an unpinned torch would pull several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
python -m pip install -q "torch==2.13.0"
python -m pip install -q "triton==3.6.0"
python -m pip install -q -e ".[engine,dev]"
