#!/usr/bin/env bash
# Tenth pass, call 5: every single-GPU test file with GPU tests, on the commit that lands the Gluon decode kernel.
set -uo pipefail
. scripts/gpu-prelude.sh /tmp/e10-dry
exec > >(tee -a "$OUT/run.log") 2>&1
git log -1 --format='commit %H' 2>/dev/null || true
echo "=== gpu tests $(date -u +%T)"
timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_async_scheduling.py tests/test_bench_attention.py \
  tests/test_cuda_graphs.py tests/test_engine_gpu.py tests/test_kernels_elementwise.py tests/test_kernels_gemv.py \
  tests/test_kernels_paged_attention.py tests/test_step_fast_paths.py 2>&1 | tail -15
echo "=== done $(date -u +%T)"
