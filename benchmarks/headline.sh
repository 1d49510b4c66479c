#!/usr/bin/env bash
# The headline figures of docs/performance/README.md on one GPU (an H100 or H200):
#   bash benchmarks/headline.sh        (results under RESULTS_DIR, default out/gpu: summary.txt, results.tgz)
# 1. throughput: qwen3-0.6b shape, 256 prompts, input 100, output 1024, ignore_eos: the engine (defaults), then
#    with an fp8 KV cache.
# 2. hf-static: transformers generate on the same workload, static cache, batch 256 (the baseline).
# 3. latency: `governor bench latency`, llama3-8b shape, 512-token context, batch 1/8/32 (roofline fraction from
#    a device copy measured in the same process).
# 4. attention: `governor bench attention`, batch 32, contexts 4K and 32K, bf16 and fp8 KV, llama3-8b heads.
# Stages run in that order under one deadline (DEADLINE_S, default 575 s); each gets min(its limit, what is
# left) and is skipped when too little is left; results land under $RESULTS_DIR as they come.
# DRY=1 runs the same flow on CPU with the tiny preset and tiny workloads (to check the script only).
set -uo pipefail
T0=$SECONDS
DEADLINE_S=${DEADLINE_S:-575}
. benchmarks/lib/prelude.sh /tmp/gpu-targets-dry
. benchmarks/lib/presets.sh
LM=/tmp/gpu-targets/llama-$L QM=/tmp/gpu-targets/qwen3-$Q R=/tmp/gpu-targets/results
. benchmarks/lib/deadline.sh
latency() {  # latency TAG ARGS...
  run_py "$1" -m governor.engine bench latency --model "$LM" --load-format dummy "${LATDEV[@]}" "${LAT[@]}" \
    "${@:2}" --output-json "$R/$1.json" && [ -s "$R/$1.json" ]
}
attention() {
  if [ "${DRY:-0}" = 1 ]; then ATT=(--device cpu --batches 2 --contexts 64 --heads 4:2 --head-dim 16 --kv-dtypes bf16)
  else ATT=(--batches 32 --contexts 4096,32768 --heads 32:8 --head-dim 128 --kv-dtypes bf16,fp8); fi
  run_py attention -m governor.engine bench attention "${ATT[@]}" --output-json "$R/attention.json" &&
    [ -s "$R/attention.json" ]
}
thr() {  # thr TAG ARGS...: one `bench throughput`, JSON to $R/thr-TAG.json
  local tag=$1
  shift
  run_py "thr-$tag" -m governor.engine bench throughput --model "$QM" "${W[@]}" "${DEV[@]}" "$@" \
    --output-json "$R/thr-$tag.json" && [ -s "$R/thr-$tag.json" ]
}

stage models 60 10 models
stage throughput 80 40 thr async
stage throughput-fp8 80 40 thr async-fp8 --kv-cache-dtype fp8
stage hf-static 160 100 thr hf-static-$HF_BATCH --backend hf --hf-batch-size $HF_BATCH \
  --hf-cache-implementation static --hf-warmup-tokens 32 --hf-progress-every 256
stage latency 100 40 latency latency
stage attention 90 30 attention

python3 scripts/summarize-gpu-results.py "$R" | tee "$RESULTS_DIR/summary.txt"
cp "$RESULTS_DIR/summary.txt" "$R/" && tar czf "$RESULTS_DIR/results.tgz" -C "$R" .
echo "total $((SECONDS - T0)) s"
if [ ${#FAILED[@]} -gt 0 ]; then echo "failed or skipped stages: ${FAILED[*]}"; exit 1; fi
