#!/usr/bin/env bash
# Ninth pass, call 3: the issue's targets (throughput bf16 / fp8 KV / transformers, batch-1 latency, attention) on the
# pass's code: split launches' merge folded or under PDL, the warm-up's ladder steps, finished texts decoded together.
set -uo pipefail
DEADLINE_S=575 bash scripts/gpu-issue9-targets.sh
