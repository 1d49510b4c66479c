#!/usr/bin/env bash
# Ninth pass, call 2: the landed merge rule (fold up to 8 splits, else the reduce kernel under PDL) against the old
# reduce kernel and the two alone; `governor bench attention` with the kernels-alone figures; the first run with the
# warm-up's ladder steps (host profile of the first and last steps); the GPU tests of this pass.
set -uo pipefail
T0=$SECONDS
. scripts/gpu-prelude.sh /tmp/e9-dry
exec > >(tee -a "$OUT/run.log") 2>&1
D=docs/experiments/issue9-ninth-pass
echo "=== ab $(date -u +%T)"
timeout 150 python3 scripts/decode-attention-ab.py "$OUT/ab-merge.json" --rounds 2 --groups fp8,bf16 --cases 32,1,8,16 \
  --variants cur,reduce,reduce-pdl,fold-all --kernels > "$OUT/ab-merge.txt" 2>&1; tail -1 "$OUT/ab-merge.txt" | cut -c1-120
echo "=== bench attention $(date -u +%T)"
timeout 90 python3 -m governor.engine bench attention --batches 32 --contexts 4096,32768 --heads 32:8 --head-dim 128 \
  --kv-dtypes bf16,fp8 --output-json "$OUT/attention.json" 2>&1 | grep -v Warning | tail -5
echo "=== model $(date -u +%T)"
timeout 60 python3 -m governor.engine make-model /tmp/q3 --arch qwen3 --preset qwen3-0.6b --dtype bfloat16 --device cuda 2>&1 | tail -1
echo "=== first run, ladder warm-up $(date -u +%T)"
timeout 150 python3 $D/first_run.py /tmp/q3 "$OUT/first-run.json" --profile "$OUT/first-run-profile.txt" \
  > "$OUT/first-run.log" 2>&1; grep -v "INFO\|Warning" "$OUT/first-run.log" | tail -12
grep "warm\|compiled in" "$OUT/first-run.log" | head -3
LEFT=$((585 - (SECONDS - T0)))
echo "=== gpu tests $(date -u +%T), $LEFT s left"
timeout $LEFT python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_paged_attention.py tests/test_bench_attention.py \
  tests/test_warm_up.py tests/test_engine_gpu.py tests/test_cuda_graphs.py 2>&1 | tail -8
echo "total $((SECONDS - T0)) s"
