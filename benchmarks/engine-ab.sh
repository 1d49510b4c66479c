#!/usr/bin/env bash
# The engine's headline speed, a base commit against this working tree, alternated on one GPU (for a change that
# must not move it, such as a restructure), from a git checkout:
#   BASE=<commit> bash benchmarks/engine-ab.sh        (results under RESULTS_DIR, default out/gpu)
# Each round runs, by the base (a git worktree of BASE, default HEAD) and then by the working tree:
#   throughput      `governor bench throughput`, qwen3-0.6b shape, 256 prompts, 100 -> 1,024 tokens, bf16 KV cache
#   throughput-fp8  the same with an fp8 KV cache
#   latency         `governor bench latency`, llama3-8b shape (random weights), 512-token context, batch 1
# ROUNDS rounds (default 2); stages run under one deadline (DEADLINE_S, default 575 s), each skipped when too little
# is left. DRY=1 runs the same flow on CPU with the tiny preset (to check the script only).
set -uo pipefail
T0=$SECONDS
DEADLINE_S=${DEADLINE_S:-575}
. benchmarks/lib/prelude.sh /tmp/engine-ab-dry
. benchmarks/lib/presets.sh
LM=/tmp/engine-ab/llama-$L QM=/tmp/engine-ab/qwen3-$Q R=/tmp/engine-ab/results BASE_TREE=/tmp/engine-ab/base
. benchmarks/lib/deadline.sh
base_tree() {
  local base=${BASE:-$(git rev-parse HEAD)}
  rm -rf "$BASE_TREE"
  git worktree prune
  git worktree add -q --detach "$BASE_TREE" "$base" && echo "base $base" | tee "$R/base.txt"
}
in_tree() {  # in_tree TREE COMMAND...: run with the code of TREE first on the path
  local tree=$1
  shift
  PYTHONPATH=$tree/engine:$tree/kernels:$tree/operator:/tmp/site:$tree "$@"
}
thr() {  # thr TAG TREE ARGS...: one `bench throughput` by the code in TREE
  local tag=$1 tree=$2
  shift 2
  in_tree "$tree" run_py "$tag" -m governor.engine bench throughput --model "$QM" "${W[@]}" "${DEV[@]}" "$@" \
    --output-json "$R/$tag.json" && [ -s "$R/$tag.json" ]
}
latency() {  # latency TAG TREE: batch-1 `bench latency` by the code in TREE
  in_tree "$2" run_py "$1" -m governor.engine bench latency --model "$LM" --load-format dummy "${LATDEV[@]}" \
    "${LAT[@]}" --batches 1 --output-json "$R/$1.json" && [ -s "$R/$1.json" ]
}

stage base-tree 30 5 base_tree
stage models 60 10 models
for i in $(seq "${ROUNDS:-2}"); do
  for side in base new; do
    tree=$PWD
    [ "$side" = base ] && tree=$BASE_TREE
    stage "thr-$side-$i" 80 40 thr "thr-$side-$i" "$tree"
    stage "thr-fp8-$side-$i" 80 40 thr "thr-fp8-$side-$i" "$tree" --kv-cache-dtype fp8
    stage "latency-$side-$i" 80 40 latency "latency-$side-$i" "$tree"
  done
done

python3 scripts/summarize-gpu-results.py "$R" | tee "$RESULTS_DIR/summary.txt"
cp "$RESULTS_DIR/summary.txt" "$R/" && tar czf "$RESULTS_DIR/results.tgz" -C "$R" .
echo "total $((SECONDS - T0)) s"
if [ ${#FAILED[@]} -gt 0 ]; then echo "failed or skipped stages: ${FAILED[*]}"; exit 1; fi
