#!/usr/bin/env bash
# Ninth pass, call 1: how split decode launches merge their partials (reduce kernel, PDL-launched reduce, folded into
# the decode kernel), per-kernel times; what the throughput workload's first run pays (default and eager CUDA module
# loading); the GPU tests of the commits not yet run on a GPU.
set -uo pipefail
T0=$SECONDS
. scripts/gpu-prelude.sh /tmp/e9-dry
exec > >(tee -a "$OUT/run.log") 2>&1
D=docs/experiments/issue9-ninth-pass
echo "=== ab $(date -u +%T)"
timeout 200 python3 scripts/decode-attention-ab.py "$OUT/ab-merge.json" --rounds 2 --groups fp8,bf16 --cases 32,1,8,16 \
  --variants cur,pdl-start,pdl-end,fold --kernels > "$OUT/ab-merge.txt" 2>&1; grep "b32 ctx4096" "$OUT/ab-merge.txt" | cut -c1-150
echo "=== model $(date -u +%T)"
timeout 60 python3 -m governor.engine make-model /tmp/q3 --arch qwen3 --preset qwen3-0.6b --dtype bfloat16 --device cuda 2>&1 | tail -1
for mode in lazy eager; do
  echo "=== first run, $mode loading $(date -u +%T)"
  env $([ $mode = eager ] && echo CUDA_MODULE_LOADING=EAGER) timeout 150 python3 $D/first_run.py /tmp/q3 "$OUT/first-run-$mode.json" \
    > "$OUT/first-run-$mode.log" 2>&1; grep -v "INFO\|Warning" "$OUT/first-run-$mode.log" | tail -14
done
LEFT=$((585 - (SECONDS - T0)))
echo "=== gpu tests $(date -u +%T), $LEFT s left"
timeout $LEFT python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_paged_attention.py tests/test_fp8_kv.py \
  tests/test_engine_gpu.py tests/test_cuda_graphs.py tests/test_async_scheduling.py tests/test_warm_up.py 2>&1 | tail -15
echo "total $((SECONDS - T0)) s"
