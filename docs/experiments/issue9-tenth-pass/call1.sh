#!/usr/bin/env bash
# Tenth pass, call 1: the Gluon fp8 decode prototype (pag.py: warps with their own keys, K/V straight into registers)
# against the landed Triton kernel, same process, same inputs; outputs compared with the Triton kernel's.
set -uo pipefail
. scripts/gpu-prelude.sh /tmp/e10-dry
exec > >(tee -a "$OUT/run.log") 2>&1
echo "=== ab $(date -u +%T)"
timeout 420 python3 docs/experiments/issue9-tenth-pass/gpu_ab.py "$OUT/ab1.json"
echo "=== done $(date -u +%T)"
