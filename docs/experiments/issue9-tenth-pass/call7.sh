#!/usr/bin/env bash
# Tenth pass, call 7 (a fresh machine): the landed Gluon kernel against the Triton kernel over every fp8 shape of
# decode-attention-ab.py, then the issue's targets again.
set -uo pipefail
. scripts/gpu-prelude.sh /tmp/e10-dry
{
  git log -1 --format='commit %H' 2>/dev/null || true
  echo "=== ab $(date -u +%T)"
  timeout 200 python3 scripts/decode-attention-ab.py "$OUT/ab-landed.json" --rounds 2 --groups fp8 \
    --variants cur,triton-kernel --kernels > "$OUT/ab-landed.txt" 2>&1
  grep " r1 " "$OUT/ab-landed.txt" | cut -c1-175
} 2>&1 | tee -a "$OUT/ab.log"
DEADLINE_S=${DEADLINE_S:-380} bash scripts/gpu-issue9-targets.sh
