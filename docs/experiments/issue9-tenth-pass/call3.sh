#!/usr/bin/env bash
# Tenth pass, call 3: the Gluon fp8 decode kernel as landed in paged_attention.py -- GPU tests of the kernels, CUDA
# graphs and engine, then the A/B against the Triton kernel and the Gluon kernel's tile/stage neighbours.
set -uo pipefail
. scripts/gpu-prelude.sh /tmp/e10-dry
exec > >(tee -a "$OUT/run.log") 2>&1
echo "=== gpu tests $(date -u +%T)"
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_paged_attention.py \
  tests/test_cuda_graphs.py tests/test_engine_gpu.py tests/test_bench_attention.py 2>&1 | tail -8
echo "=== ab $(date -u +%T)"
timeout 240 python3 scripts/decode-attention-ab.py "$OUT/ab-gluon.json" --rounds 2 --groups fp8 --cases 32,256,8,64,1,16 \
  --variants cur,triton-kernel,gluon-t16,gluon-t64,gluon-s2,gluon-s4 --kernels > "$OUT/ab-gluon.txt" 2>&1
grep -v "^\s*$" "$OUT/ab-gluon.txt" | tail -80 | cut -c1-160
echo "=== done $(date -u +%T)"
