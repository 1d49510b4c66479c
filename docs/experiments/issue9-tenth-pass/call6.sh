#!/usr/bin/env bash
# Tenth pass, call 6: the issue's targets on the commit that lands the Gluon decode kernel (attention, throughput fp8
# and bf16 against transformers, batch-1 latency).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560} bash scripts/gpu-issue9-targets.sh
