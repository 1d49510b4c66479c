#!/usr/bin/env bash
# Tenth pass, call 2: the Gluon prototype with K/V staged through shared memory by cp.async (STAGES deep), against
# the Triton kernel, same process.
set -uo pipefail
. scripts/gpu-prelude.sh /tmp/e10-dry
exec > >(tee -a "$OUT/run.log") 2>&1
echo "=== ab $(date -u +%T)"
VARIANTS=W4T16S3:4:16:3,W4T16S4:4:16:4,W4T32S2:4:32:2,W4T32S3:4:32:3,W2T32S3:2:32:3,W1T32S3:1:32:3,W1T32S4:1:32:4 \
SPLITMULTS=1,2,4 BATCHES=32,256,8,64 timeout 400 python3 docs/experiments/issue9-tenth-pass/gpu_ab.py "$OUT/ab2.json"
echo "=== done $(date -u +%T)"
