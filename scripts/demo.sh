#!/usr/bin/env bash
# The main job on the embedded default (no cluster, no GPU, all on CPU): set up .venv, then
# `governor demo` — generate a small random model, start an engine on 127.0.0.1, drive a workload that
# shifts, and run the SLO tuner against the engine's own /metrics: static defaults vs tuned.
# Writes decisions.jsonl, timeline.jsonl, summary.json and timeline.png to $GOVERNOR_DEMO_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec governor demo --duration "${GOVERNOR_DEMO_DURATION:-300}" --out "${GOVERNOR_DEMO_DIR:-out/demo}"
