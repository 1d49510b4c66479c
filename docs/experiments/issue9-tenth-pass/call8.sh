#!/usr/bin/env bash
# Tenth pass, call 8: the Gluon fold's merge unrolled over the splits. GPU tests of the kernels and CUDA graphs, then
# the split shapes against d5eaa33's kernel module (pa_d5eaa33.py: `git show d5eaa33:kernels/governor/kernels/
# paged_attention.py > pa_d5eaa33.py` in the repository root) and the Triton kernel, in one process.
set -uo pipefail
. scripts/gpu-prelude.sh /tmp/e10-dry
exec > >(tee -a "$OUT/run.log") 2>&1
echo "=== gpu tests $(date -u +%T)"
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_paged_attention.py tests/test_cuda_graphs.py \
  2>&1 | tail -3
echo "=== ab $(date -u +%T)"
timeout 200 python3 scripts/decode-attention-ab.py "$OUT/ab-merge.json" --rounds 3 --groups fp8 --cases 32,8,16,1 \
  --baseline pa_d5eaa33.py --variants cur,triton-kernel --kernels > "$OUT/ab-merge.txt" 2>&1
grep " r[12] " "$OUT/ab-merge.txt" | cut -c1-175
echo "=== done $(date -u +%T)"
