#!/usr/bin/env bash
# Ninth pass, call 7 (after review): the single-GPU tests on the final code (direct Rust decode of texts, fold
# counters that never move, the PDL launch spy under a CUDA graph), then the throughput target once more.
set -uo pipefail
. scripts/gpu-prelude.sh /tmp/e9-dry
. scripts/gpu-issue9-presets.sh
exec > >(tee -a "$OUT/run.log") 2>&1
echo "=== gpu tests $(date -u +%T)"
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_async_scheduling.py tests/test_bench_attention.py \
  tests/test_cuda_graphs.py tests/test_engine_gpu.py tests/test_kernels_elementwise.py tests/test_kernels_gemv.py \
  tests/test_kernels_paged_attention.py tests/test_step_fast_paths.py 2>&1 | tail -4
timeout 60 python3 -m governor.engine make-model /tmp/q3 --arch qwen3 --preset qwen3-0.6b --dtype bfloat16 --device cuda 2>&1 | tail -1
for b in governor hf; do
  echo "=== $b $(date -u +%T)"
  extra=(--kv-cache-dtype fp8)
  [ $b = hf ] && extra=(--backend hf --hf-batch-size 256 --hf-cache-implementation static --hf-warmup-tokens 32 --hf-progress-every 256)
  timeout 170 python3 -m governor.engine bench throughput --model /tmp/q3 "${W[@]}" "${extra[@]}" \
    --output-json "$OUT/thr-$b.json" > "$OUT/thr-$b.log" 2>&1
  python3 -c "import json; r=json.load(open('$OUT/thr-$b.json'))['result']; print('$b', round(r['output_tokens_per_s']), 'tok/s', round(r['elapsed_s'], 2), 's')"
done
