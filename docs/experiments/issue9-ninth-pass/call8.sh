#!/usr/bin/env bash
# Ninth pass, call 8 (after the second review): the fold and the reduce kernel share `_merge_partials` (the reduce
# kernel now merges a [1, splits] row); the kernels' GPU tests, then the merge A/B once more.
set -uo pipefail
. scripts/gpu-prelude.sh /tmp/e9-dry
exec > >(tee -a "$OUT/run.log") 2>&1
echo "=== gpu tests $(date -u +%T)"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_paged_attention.py tests/test_bench_attention.py \
  tests/test_cuda_graphs.py 2>&1 | tail -3
echo "=== ab $(date -u +%T)"
timeout 150 python3 scripts/decode-attention-ab.py "$OUT/ab-merge.json" --rounds 2 --groups fp8,bf16 --cases 32,1,8,16 \
  --variants cur,reduce,reduce-pdl,fold-all --kernels > "$OUT/ab-merge.txt" 2>&1; tail -2 "$OUT/ab-merge.txt" | cut -c1-150
