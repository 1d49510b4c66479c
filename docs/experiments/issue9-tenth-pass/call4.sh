#!/usr/bin/env bash
# Tenth pass, call 4: tiles by launch width (64 keys for launches of one wave of 4 programs per SM, 16 above) and a
# register cap on the 16-key launches; GPU tests, then the A/B over every fp8 shape of decode-attention-ab.py.
set -uo pipefail
. scripts/gpu-prelude.sh /tmp/e10-dry
exec > >(tee -a "$OUT/run.log") 2>&1
echo "=== gpu tests $(date -u +%T)"
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_paged_attention.py \
  tests/test_cuda_graphs.py tests/test_engine_gpu.py tests/test_bench_attention.py 2>&1 | tail -25
echo "=== ab $(date -u +%T)"
timeout 270 python3 scripts/decode-attention-ab.py "$OUT/ab-gluon.json" --rounds 2 --groups fp8 \
  --cases 32,256,8,64,1,16,48,128,160,192 \
  --variants cur,triton-kernel,gluon-narrow32,gluon-wide32,gluon-wide64,gluon-wide-ptxas-regs --kernels \
  > "$OUT/ab-gluon.txt" 2>&1
grep " r1 " "$OUT/ab-gluon.txt" | cut -c1-175
echo "=== done $(date -u +%T)"
