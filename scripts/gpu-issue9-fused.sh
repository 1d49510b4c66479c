#!/usr/bin/env bash
# Issue 9, after the fused elementwise kernels, per-sequence split-KV partitions and the host-time cuts, on one
# GPU through the device tool:
#   run(command="bash scripts/gpu-issue9-fused.sh", carry=[".whl"], timeout_s=600)
# 1. tests: the GPU tests of the fused kernels, paged attention, CUDA graphs and the engine.
# 2. latency: `governor bench latency`, llama3-8b shape, 512-token context, batch 1/8/32, CUDA graphs (the
#    roofline is weight bytes over a 1 GiB device-to-device copy measured in the same process); then again
#    (latency-warm) in a second process that finds the first one's Triton kernels compiled on disk.
# 3. profile-b1: CUDA kernel time by kernel of batch-1 decode steps (scripts/profile-decode.py).
# 4. attention: `governor bench attention` at the issue's cases (batch 32, 4K and 32K, llama3-8b heads, bf16
#    and fp8) and at the throughput workload's decode shape (batch 256, 1K, qwen3-0.6b heads).
# 5. throughput: qwen3-0.6b shape, 256 prompts, input 100, output 1024, ignore_eos, the engine (defaults),
#    then with an fp8 KV cache (--kv-cache-dtype fp8).
# 6. host: per-phase host time of the throughput workload's decode steps (scripts/profile-host.py).
# 7. hf-static: transformers generate on the same workload, static cache, batch 256 (the baseline).
# 8. profile-b256: kernel time by kernel at batch 256, qwen3-0.6b shape (if time is left).
# Stages run in that order under one deadline (DEADLINE_S, default 575 s); each gets min(its limit, what is
# left) and is skipped when too little is left; results land under $OUT as they come.
# DRY=1 runs the same flow on CPU with the tiny preset and tiny workloads (to check the script only).
set -uo pipefail
T0=$SECONDS
DEADLINE_S=${DEADLINE_S:-575}
. scripts/gpu-prelude.sh /tmp/issue9f-dry
. scripts/gpu-issue9-presets.sh
if [ "${DRY:-0}" = 1 ]; then
  PROF1=(--batch 1 --context 16 --steps 3 device=cpu dtype=float32 load_format=dummy)
  PROF256=(--batch 4 --context 16 --steps 3 device=cpu dtype=float32)
  HOST=(--device cpu --batch 8 --prompt-len 16 --new-tokens 8 dtype=float32)
  ATT1=(--device cpu --batches 2 --contexts 64 --heads 4:2 --head-dim 16 --warmup 1 --iters 2)
  ATT2=(--device cpu --batches 4 --contexts 32 --heads 4:2 --head-dim 16 --warmup 1 --iters 2)
else
  PROF1=(--batch 1 --context 512 --steps 20 load_format=dummy dtype=bfloat16 max_model_len=4096)
  PROF256=(--batch 256 --context 512 --steps 20 dtype=bfloat16 max_num_batched_tokens=16384)
  HOST=(--device cuda --batch 256 --prompt-len 100 --new-tokens 1024 dtype=bfloat16 max_model_len=40960)
  ATT1=(--batches 32 --contexts 4096,32768 --heads 32:8 --head-dim 128 --kv-dtypes bf16,fp8)
  ATT2=(--batches 256 --contexts 1024 --heads 16:8 --head-dim 128 --kv-dtypes bf16,fp8)
fi
LM=/tmp/issue9f/llama-$L QM=/tmp/issue9f/qwen3-$Q R=/tmp/issue9f/results
mkdir -p "$R"
exec > >(tee -a "$OUT/run.log") 2>&1
cp "$OUT/gpu.txt" "$R/" 2>/dev/null || true
. scripts/gpu-deadline.sh
tests() {
  [ "${DRY:-0}" = 1 ] && { echo "(dry run: no GPU tests)"; return 0; }
  run_py gpu-tests -m pytest -q -m gpu -p no:cacheprovider -rs --durations=5 tests/test_kernels_elementwise.py \
    tests/test_kernels_paged_attention.py tests/test_cuda_graphs.py tests/test_engine_gpu.py
}
models() {
  [ -f "$LM/config.json" ] || run_py make-llama -m governor.engine make-model "$LM" --arch llama --preset $L \
    --no-weights --dtype bfloat16 || return 1
  [ -f "$QM/config.json" ] || run_py make-qwen -m governor.engine make-model "$QM" --arch qwen3 --preset $Q "${MK[@]}"
}
latency() {  # latency TAG
  run_py "$1" -m governor.engine bench latency --model "$LM" --load-format dummy "${LATDEV[@]}" "${LAT[@]}" \
    --output-json "$R/$1.json" && [ -s "$R/$1.json" ]
}
att() { run_py "$1" -m governor.engine bench attention "${@:2}" --output-json "$R/$1.json"; }
prof() { run_py "profile-$1" scripts/profile-decode.py "$2" "$R/profile-$1.json" "${@:3}"; }
thr() {  # thr TAG ARGS...: one `bench throughput`, JSON to $R/thr-TAG.json
  local tag=$1
  shift
  run_py "thr-$tag" -m governor.engine bench throughput --model "$QM" "${W[@]}" "${DEV[@]}" "$@" \
    --output-json "$R/thr-$tag.json" && [ -s "$R/thr-$tag.json" ]
}
host() { run_py host scripts/profile-host.py "$QM" "${HOST[@]}"; }

stage tests 200 60 tests
stage models 60 10 models
stage latency 120 40 latency latency
stage latency-warm 120 40 latency latency-warm
stage profile-b1 60 30 prof b1 "$LM" "${PROF1[@]}"
stage attention 60 20 att attention "${ATT1[@]}"
stage attention-b256 40 15 att attention-b256 "${ATT2[@]}"
stage throughput 90 40 thr governor
stage throughput-fp8 90 40 thr governor-fp8 --kv-cache-dtype fp8
stage host 90 30 host
stage hf-static 180 100 thr hf-static-$HF_BATCH --backend hf --hf-batch-size $HF_BATCH \
  --hf-cache-implementation static --hf-warmup-tokens 32 --hf-progress-every 256
stage profile-b256 60 30 prof b256 "$QM" "${PROF256[@]}"

python3 scripts/summarize-gpu-results.py "$R" | tee "$OUT/summary.txt"
cp "$OUT/summary.txt" "$R/" && tar czf "$OUT/results.tgz" -C "$R" .
echo "total $((SECONDS - T0)) s"
if [ ${#FAILED[@]} -gt 0 ]; then echo "failed or skipped stages: ${FAILED[*]}"; exit 1; fi
