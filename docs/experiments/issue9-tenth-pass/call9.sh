#!/usr/bin/env bash
# Tenth pass, call 9: the throughput workload (fp8 KV) with the Gluon decode kernel and with the Triton one, alternated
# on one machine (thr_ab.py sets paged_attention._GLUON_DECODE from GLUON_DECODE), then the GPU tests of the kernels.
set -uo pipefail
. scripts/gpu-prelude.sh /tmp/e10-dry
exec > >(tee -a "$OUT/run.log") 2>&1
git log -1 --format='commit %H' 2>/dev/null || true
Q=/tmp/e10/qwen3
python3 -m governor.engine make-model "$Q" --arch qwen3 --preset qwen3-0.6b --dtype bfloat16 --device cuda > /dev/null
for round in 1 2; do
  for g in 1 0; do
    echo "=== round $round GLUON_DECODE=$g $(date -u +%T)"
    GLUON_DECODE=$g timeout 120 python3 docs/experiments/issue9-tenth-pass/thr_ab.py bench throughput --model "$Q" \
      --num-prompts 256 --input-len 100:100 --output-len 1024:1024 --kv-cache-dtype fp8 \
      --output-json "$OUT/thr-r$round-gluon$g.json" 2>&1 | grep -i "tok/s" | tail -2
  done
done
echo "=== gpu tests $(date -u +%T)"
timeout 260 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_paged_attention.py tests/test_cuda_graphs.py tests/test_engine_gpu.py \
  2>&1 | tail -3
echo "=== done $(date -u +%T)"
