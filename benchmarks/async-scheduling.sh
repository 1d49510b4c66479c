#!/usr/bin/env bash
# Async scheduling against one step at a time on one GPU:
#   bash benchmarks/async-scheduling.sh        (results under RESULTS_DIR, default out/gpu)
# 1. tests: the GPU tests of async scheduling, CUDA graphs and the engine (greedy tokens = transformers fp32),
#    and the (CPU) test that the kernel warm-up leaves no trace.
# 1b. compile-check: with an empty Triton cache, which kernels still compile once requests run after the engine
#    started (scripts/compile-check.py, llama3-8b shape as served).
# 2. throughput: qwen3-0.6b shape, 256 prompts, input 100, output 1024, ignore_eos: the engine with async
#    scheduling (the default), then one step at a time (--no-async-scheduling), then both with an fp8 KV cache.
# 3. host: per-phase host time and GPU busy/idle of that workload's decode steps (scripts/profile-host.py), async
#    and one step at a time.
# 4. hf-static: transformers generate on the same workload, static cache, batch 256 (the baseline).
# 5. latency: `governor bench latency`, llama3-8b shape, 512-token context, batch 1/8/32, async (with an empty
#    Triton cache: its TTFTs are a first process's) then one step at a time.
# 6. gemv: the llama3-8b decode GEMMs at batch 1/8/32 under cuBLAS and cuBLASLt (scripts/gemv-probe.py), when
#    GEMV=1.
# Stages run in that order under one deadline (DEADLINE_S, default 575 s); each gets min(its limit, what is
# left) and is skipped when too little is left; results land under $RESULTS_DIR as they come.
# DRY=1 runs the same flow on CPU with the tiny preset and tiny workloads (to check the script only).
set -uo pipefail
T0=$SECONDS
DEADLINE_S=${DEADLINE_S:-575}
. benchmarks/lib/prelude.sh /tmp/gpu-async-dry
. benchmarks/lib/presets.sh
if [ "${DRY:-0}" = 1 ]; then
  HOST=(--device cpu --batch 8 --prompt-len 16 --new-tokens 8 dtype=float32)
  CC=(device=cpu dtype=float32 max_model_len=1024 load_format=dummy)
else
  HOST=(--device cuda --batch 256 --prompt-len 100 --new-tokens 1024 dtype=bfloat16 max_model_len=40960)
  CC=(load_format=dummy dtype=bfloat16 max_model_len=4096)
fi
LM=/tmp/gpu-async/llama-$L QM=/tmp/gpu-async/qwen3-$Q R=/tmp/gpu-async/results
. benchmarks/lib/deadline.sh
tests() {
  [ "${DRY:-0}" = 1 ] && { echo "(dry run: no GPU tests)"; return 0; }
  run_py gpu-tests -m pytest -q -m gpu -p no:cacheprovider -rs --durations=5 tests/test_async_scheduling.py \
    tests/test_cuda_graphs.py tests/test_engine_gpu.py &&
    run_py warm-up-test -m pytest -q -p no:cacheprovider tests/test_warm_up.py
}
compile_check() {
  local cache
  cache=$(mktemp -d)
  TRITON_CACHE_DIR=$cache run_py compile-check scripts/compile-check.py "$LM" "${CC[@]}"
}
latency_cold() {
  local cache
  cache=$(mktemp -d)
  TRITON_CACHE_DIR=$cache latency latency-async
}
latency() {  # latency TAG ARGS...
  run_py "$1" -m governor.engine bench latency --model "$LM" --load-format dummy "${LATDEV[@]}" "${LAT[@]}" \
    "${@:2}" --output-json "$R/$1.json" && [ -s "$R/$1.json" ]
}
thr() {  # thr TAG ARGS...: one `bench throughput`, JSON to $R/thr-TAG.json
  local tag=$1
  shift
  run_py "thr-$tag" -m governor.engine bench throughput --model "$QM" "${W[@]}" "${DEV[@]}" "$@" \
    --output-json "$R/thr-$tag.json" && [ -s "$R/thr-$tag.json" ]
}
host() { run_py "$1" scripts/profile-host.py "$QM" "${HOST[@]}" "${@:2}"; }
gemv() {
  [ "${DRY:-0}" = 1 ] && { echo "(dry run: no GEMM probe, it needs CUDA)"; return 0; }
  run_py gemv scripts/gemv-probe.py --output-json "$R/gemv.json"
}

stage tests 150 60 tests
stage models 60 10 models
stage compile-check 90 40 compile_check
stage throughput 80 40 thr async
stage throughput-sync 80 40 thr sync --no-async-scheduling
stage throughput-fp8 80 40 thr async-fp8 --kv-cache-dtype fp8
stage throughput-fp8-sync 80 40 thr sync-fp8 --kv-cache-dtype fp8 --no-async-scheduling
stage host 70 30 host host-async
stage host-sync 70 30 host host-sync async_scheduling=false
stage hf-static 160 100 thr hf-static-$HF_BATCH --backend hf --hf-batch-size $HF_BATCH \
  --hf-cache-implementation static --hf-warmup-tokens 32 --hf-progress-every 256
stage latency 100 40 latency_cold
stage latency-sync 100 40 latency latency-sync --no-async-scheduling
[ "${GEMV:-0}" = 1 ] && stage gemv 60 20 gemv

python3 scripts/summarize-gpu-results.py "$R" | tee "$RESULTS_DIR/summary.txt"
cp "$RESULTS_DIR/summary.txt" "$R/" && tar czf "$RESULTS_DIR/results.tgz" -C "$R" .
echo "total $((SECONDS - T0)) s"
if [ ${#FAILED[@]} -gt 0 ]; then echo "failed or skipped stages: ${FAILED[*]}"; exit 1; fi
