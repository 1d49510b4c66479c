#!/usr/bin/env bash
# Issue 9, async scheduling: why the throughput run gains less than the per-step profile says. On one GPU:
#   run(command="bash scripts/gpu-issue9-async-diag.sh", carry=[".whl"], timeout_s=600)
# The throughput workload's decode steps through scripts/profile-host.py (with its decode totals: wall, step
# mean/p99/max, GPU busy/idle, garbage-collector time), async and one step at a time, each with and without
# gc.freeze() after the warm-up; then `bench throughput` async and one step at a time again.
set -uo pipefail
T0=$SECONDS
DEADLINE_S=${DEADLINE_S:-560}
. scripts/gpu-env.sh
Q=qwen3-0.6b QM=/tmp/issue9a/qwen3-qwen3-0.6b R=/tmp/issue9a/diag
mkdir -p "$R"
exec > >(tee -a "$OUT/run.log") 2>&1
git log -1 --format='commit %H' > "$R/commit.txt" 2>/dev/null || true
. scripts/gpu-deadline.sh
HOST=(--device cuda --batch 256 --prompt-len 100 --new-tokens 1024 dtype=bfloat16 max_model_len=40960)
W=(--num-prompts 256 --input-len 100:100 --output-len 1024:1024)
models() {
  [ -f "$QM/config.json" ] || run_py make-qwen -m governor.engine make-model "$QM" --arch qwen3 --preset $Q \
    --dtype bfloat16 --device cuda
}
host() { run_py "$1" scripts/profile-host.py "$QM" "${HOST[@]}" "${@:2}"; }
thr() {
  local tag=$1
  shift
  run_py "thr-$tag" -m governor.engine bench throughput --model "$QM" "${W[@]}" "$@" --output-json "$R/thr-$tag.json"
}
stage models 60 10 models
stage host-async 70 30 host host-async
stage host-sync 70 30 host host-sync async_scheduling=false
stage host-async-freeze 70 30 host host-async-freeze --gc-freeze
stage host-sync-freeze 70 30 host host-sync-freeze --gc-freeze async_scheduling=false
stage thr-async 80 40 thr async
stage thr-sync 80 40 thr sync --no-async-scheduling
python3 scripts/summarize-gpu-results.py "$R" | tee "$OUT/summary.txt"
tar czf "$OUT/results.tgz" -C "$R" .
echo "total $((SECONDS - T0)) s"
