#!/usr/bin/env bash
# Issue 9's remaining targets, measured side by side in one call on one GPU, through the device tool:
#   run(command="bash scripts/gpu-issue9-measure.sh", carry=[".whl"], timeout_s=500)
# 1. attention: the paged decode attention kernel alone (`governor bench attention`), batch 32, contexts
#    4K and 32K, bf16 and fp8 KV, KV bytes read / kernel time against a 1 GiB device-to-device copy of
#    the same process; then a diagnostic sweep (split-KV counts, random vs contiguous block tables).
# 2. throughput: qwen3-0.6b shape (random weights written once, both backends read the same directory),
#    256 prompts, input 100, output 1024, ignore_eos: the engine (defaults: CUDA graphs on), then
#    transformers generate: static cache (transformers compiles the decode step itself) at batch 256,
#    then the dynamic cache at batch 64 (first of 4 batches timed; all batches have the same shape) and
#    at batch 256 (the whole workload).
# 3. profile: CUDA kernel time by kernel of the engine's batch-256 decode steps (scripts/profile-decode.py).
# Stages run in that order (the attention sweep after transformers at batch 64) under one deadline
# (DEADLINE_S, default 470 s from the start): each gets min(its own limit, what is left) and is skipped
# when too little is left; results land under $OUT as they come, so a cut-off run returns what finished.
# `governor bench serve` is not run (no fastapi there).
# DRY=1 runs the same flow on CPU with the tiny preset and tiny workloads (to check the script only).
set -uo pipefail
T0=$SECONDS
DEADLINE_S=${DEADLINE_S:-470}
. scripts/gpu-prelude.sh /tmp/issue9m-dry
if [ "${DRY:-0}" = 1 ]; then
  PRESET=tiny MK=(--dtype float32) DEV=(--device cpu --dtype float32)
  ATT=(--device cpu --batches 2 --contexts 64 --heads 4:2 --head-dim 16 --warmup 1 --iters 2)
  DIAG=(--device cpu --batches 2 --contexts 128 --heads 4:2 --head-dim 16 --kv-dtypes bf16 --splits 1,2
        --tables random,contiguous --warmup 1 --iters 2)
  W=(--num-prompts 8 --input-len 10:10 --output-len 12:12)
  HF_BIG=4 HF_SMALL=2 PROF=(--batch 4 --context 16 --steps 3 device=cpu dtype=float32)
else
  PRESET=qwen3-0.6b MK=(--dtype bfloat16 --device cuda) DEV=()
  ATT=(--batches 32 --contexts 4096,32768 --heads 32:8,32:4,16:8 --head-dim 128 --kv-dtypes bf16,fp8)
  DIAG=(--batches 32 --contexts 4096,32768 --heads 32:8 --head-dim 128 --kv-dtypes bf16,fp8
        --splits auto,1,2,4,8,16,32,64 --tables random,contiguous)
  W=(--num-prompts 256 --input-len 100:100 --output-len 1024:1024)
  HF_BIG=256 HF_SMALL=64 PROF=(--batch 256 --context 512 --steps 20 dtype=bfloat16 max_num_batched_tokens=16384)
fi
M=/tmp/issue9m/$PRESET R=/tmp/issue9m/results  # results gather in R; $OUT gets a tarball of it after each stage
mkdir -p "$R"
exec > >(tee -a "$OUT/run.log") 2>&1  # $OUT keeps few files: gpu.txt, run.log, results.tgz, summary
cp "$OUT/gpu.txt" "$R/" 2>/dev/null || true
. scripts/gpu-deadline.sh
model() { [ -f "$M/config.json" ] || run_py make-model -m governor.engine make-model "$M" --arch qwen3 --preset $PRESET "${MK[@]}"; }
att() { run_py "$1" -m governor.engine bench attention "${@:2}" --output-json "$R/$1.json"; }
thr() {  # thr TAG ARGS...: one `bench throughput`, JSON to $R/thr-TAG.json
  local tag=$1
  shift
  run_py "thr-$tag" -m governor.engine bench throughput --model "$M" "${W[@]}" "${DEV[@]}" "$@" \
    --output-json "$R/thr-$tag.json" && [ -s "$R/thr-$tag.json" ]
}
prof() { run_py profile-b256 scripts/profile-decode.py "$M" "$R/profile-b256.json" "${PROF[@]}"; }

stage attention 90 20 att attention "${ATT[@]}"
stage model 60 10 model
stage engine 150 40 thr governor
stage hf-static 180 60 thr hf-static-$HF_BIG --backend hf --hf-batch-size $HF_BIG --hf-cache-implementation static \
  --hf-warmup-tokens 32 --hf-progress-every 256
stage hf-dynamic-small 70 30 thr hf-dynamic-$HF_SMALL --backend hf --hf-batch-size $HF_SMALL --hf-max-batches 1 \
  --hf-warmup-tokens 16 --hf-progress-every 256
stage attention-diag 70 20 att attention-diag "${DIAG[@]}"
stage hf-dynamic-big 150 40 thr hf-dynamic-$HF_BIG --backend hf --hf-batch-size $HF_BIG --hf-warmup-tokens 16 \
  --hf-progress-every 256
stage profile 60 30 prof

python3 scripts/summarize-gpu-results.py "$R" | tee "$OUT/issue9m-summary.txt"
cp "$OUT/issue9m-summary.txt" "$R/" && tar czf "$OUT/results.tgz" -C "$R" .
echo "total $((SECONDS - T0)) s"
if [ ${#FAILED[@]} -gt 0 ]; then echo "failed or skipped stages: ${FAILED[*]}"; exit 1; fi
