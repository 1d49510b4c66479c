#!/usr/bin/env bash
# Batch-1 decode of a base commit against this working tree, alternated on one GPU, with the one-row GEMV's sweep
# against cuBLAS (docs/design/gemv.md), from a git checkout:
#   BASE=<commit> bash benchmarks/gemv-ab.sh        (results under RESULTS_DIR, default out/gpu)
# 1. tests: the GPU tests of the GEMV, the paged-attention kernels, CUDA graphs, the engine (greedy tokens
#    = transformers fp32) and async scheduling (TESTS=0 skips them).
# 2. sweep: scripts/gemv-sweep.py, the GEMV's launch configurations against cuBLAS on the llama3-8b decode
#    shapes (SWEEP=0 skips it; SWEEP_S bounds it, default 220 s).
# 3. latency A/B: `governor bench latency`, llama3-8b shape, 512-token context, batch 1 (LAT_BATCHES), run
#    alternately ROUNDS times (default 2) by the base commit (BASE, default HEAD: a git worktree of it) and by the
#    working tree. NEW_ONLY="FILE..." measures instead the base plus only those files of the working tree (another
#    worktree), to separate one change from others.
# 4. profile: scripts/profile-decode.py of the new tree at batch 1 (kernel time and count per step).
# 5. small: the latency A/B (batch 1, 512 context) on the qwen3-0.6b shape as well, when SMALL=1.
# Stages run in that order under one deadline (DEADLINE_S, default 575 s).
# DRY=1 runs the same flow on CPU with the tiny preset and tiny workloads (to check the script only).
set -uo pipefail
T0=$SECONDS
DEADLINE_S=${DEADLINE_S:-575}
. benchmarks/lib/prelude.sh /tmp/gpu-gemv-ab-dry
if [ "${DRY:-0}" = 1 ]; then
  L=tiny Q=tiny
  LATDEV=(--device cpu --dtype float32 --max-model-len 256) LAT=(--context 32 --batches 1 --new-tokens 8)
  PD=(--batch 1 --context 32 --steps 4 device=cpu dtype=float32 load_format=dummy max_model_len=256)
else
  L=llama3-8b Q=qwen3-0.6b
  LATDEV=(--dtype bfloat16 --max-model-len 4096)
  LAT=(--context 512 --batches "${LAT_BATCHES:-1}" --new-tokens 128)
  PD=(--batch 1 --context 512 --steps 20 load_format=dummy dtype=bfloat16 max_model_len=4096)
fi
LM=/tmp/gpu-gemv-ab/llama-$L QC=/tmp/gpu-gemv-ab/qwen3-config-$Q R=/tmp/gpu-gemv-ab/results BASE_TREE=/tmp/gpu-gemv-ab/base
NEW_TREE=$PWD
[ -n "${NEW_ONLY:-}" ] && NEW_TREE=/tmp/gpu-gemv-ab/new
. benchmarks/lib/deadline.sh
trees() {  # the base worktree, and the new one when NEW_ONLY names files
  local base=${BASE:-$(git rev-parse HEAD)} f
  rm -rf "$BASE_TREE" /tmp/gpu-gemv-ab/new
  git worktree prune
  git worktree add -q --detach "$BASE_TREE" "$base" && echo "base $base" | tee "$R/base.txt" || return 1
  [ -n "${NEW_ONLY:-}" ] || return 0
  git worktree add -q --detach "$NEW_TREE" "$base" || return 1
  for f in $NEW_ONLY; do mkdir -p "$NEW_TREE/$(dirname "$f")" && cp "$f" "$NEW_TREE/$f" || return 1; done
  echo "new = base + $NEW_ONLY" | tee -a "$R/base.txt"
}
in_new() { (cd "$NEW_TREE" && PYTHONPATH=$NEW_TREE/engine:$NEW_TREE/kernels:$NEW_TREE/operator:/tmp/site:$NEW_TREE "$@"); }
tests() {
  [ "${DRY:-0}" = 1 ] && { echo "(dry run: no GPU tests)"; return 0; }
  in_new run_py gpu-tests -m pytest -q -m gpu -p no:cacheprovider -rs --durations=5 tests/test_kernels_gemv.py \
    tests/test_kernels_paged_attention.py tests/test_cuda_graphs.py tests/test_engine_gpu.py \
    tests/test_async_scheduling.py
}
sweep() {
  [ "${DRY:-0}" = 1 ] && { echo "(dry run: no sweep, it needs CUDA)"; return 0; }
  run_py sweep scripts/gemv-sweep.py --deadline-s "${SWEEP_S:-220}" --output-json "$R/sweep.json"
}
models() {
  [ -f "$LM/config.json" ] || run_py make-llama -m governor.engine make-model "$LM" --arch llama --preset $L \
    --no-weights --dtype bfloat16 || return 1
  if [ "${SMALL:-0}" = 1 ] && [ ! -f "$QC/config.json" ]; then
    run_py make-qwen-config -m governor.engine make-model "$QC" --arch qwen3 --preset $Q --no-weights \
      --dtype bfloat16 || return 1
  fi
}
latency() {  # latency TAG TREE MODEL: `bench latency` of the code in TREE
  local tree=$2
  PYTHONPATH=$tree/engine:$tree/kernels:$tree/operator:/tmp/site:$tree run_py "$1" -m governor.engine bench latency \
    --model "$3" --load-format dummy "${LATDEV[@]}" "${LAT[@]}" --output-json "$R/$1.json" && [ -s "$R/$1.json" ]
}
ab() {  # ab PREFIX MODEL: the latency of the base and the new tree, alternately, ROUNDS times
  local i
  for i in $(seq "${ROUNDS:-2}"); do
    stage "$1-base-$i" 80 40 latency "$1-base-$i" "$BASE_TREE" "$2"
    stage "$1-new-$i" 80 40 latency "$1-new-$i" "$NEW_TREE" "$2"
  done
}
profile() {
  [ "${DRY:-0}" = 1 ] && { echo "(dry run: no profile, it needs CUDA)"; return 0; }
  in_new run_py profile scripts/profile-decode.py "$LM" "$R/profile-new.json" "${PD[@]}"
}

stage trees 30 5 trees
[ "${TESTS:-1}" = 1 ] && stage tests 150 60 tests
[ "${SWEEP:-1}" = 1 ] && stage sweep $((${SWEEP_S:-220} + 40)) 60 sweep
stage models 60 10 models
ab latency "$LM"
stage profile 80 40 profile
[ "${SMALL:-0}" = 1 ] && ab latency-small "$QC"

python3 scripts/summarize-gpu-results.py "$R" | tee "$RESULTS_DIR/summary.txt"
cp "$RESULTS_DIR/summary.txt" "$R/" && tar czf "$RESULTS_DIR/results.tgz" -C "$R" .
echo "total $((SECONDS - T0)) s"
if [ ${#FAILED[@]} -gt 0 ]; then echo "failed or skipped stages: ${FAILED[*]}"; exit 1; fi
