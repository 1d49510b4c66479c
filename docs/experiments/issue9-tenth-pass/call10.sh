#!/usr/bin/env bash
# Tenth pass, call 10: after the second review the Gluon kernel calls _partition_size and _fp16_range; its GPU tests
# and the fp8 ones of the kernels and CUDA graphs, then the attention target once more.
set -uo pipefail
. scripts/gpu-prelude.sh /tmp/e10-dry
exec > >(tee -a "$OUT/run.log") 2>&1
git log -1 --format='commit %H' 2>/dev/null || true
echo "=== gpu tests $(date -u +%T)"
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_paged_attention.py tests/test_cuda_graphs.py \
  -k "fp8 or gluon or merges" 2>&1 | tail -3
echo "=== attention $(date -u +%T)"
timeout 120 python3 -m governor.engine bench attention --batches 32 --contexts 4096,32768 --heads 32:8 --head-dim 128 \
  --kv-dtypes fp8 --output-json "$OUT/attention.json" 2>&1 | tail -4
echo "=== done $(date -u +%T)"
