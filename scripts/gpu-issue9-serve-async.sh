#!/usr/bin/env bash
# Issue 9, serving with async scheduling, on one GPU through the device tool:
#   run(command="bash scripts/gpu-issue9-serve-async.sh", carry=[".whl"], timeout_s=600)
# 1. compile-check: with an empty Triton cache, which kernels (per specialization) still compile once requests
#    run after the engine has started (scripts/compile-check.py, llama3-8b shape as served).
# 2. the serving sweep (scripts/gpu-issue9-serve.sh: concurrency 1/16/64/256) with the defaults (async
#    scheduling on), results under $OUT/async;
# 3. the same sweep with --no-async-scheduling, under $OUT/sync.
# DRY=1 checks the flow on CPU.
set -uo pipefail
if [ "${DRY:-0}" = 1 ]; then
  OUT=${OUT:-/tmp/issue9sa-dry}; mkdir -p "$OUT"
  export PYTHONPATH=$PWD/engine:$PWD/kernels:$PWD/operator:$PWD PYTHONUNBUFFERED=1
  CC=(device=cpu dtype=float32 max_model_len=1024 load_format=dummy) PRESET=tiny MK=()
else
  . scripts/gpu-env.sh
  CC=(load_format=dummy dtype=bfloat16 max_model_len=4096) PRESET=llama3-8b MK=(--dtype bfloat16)
fi
BASE=$OUT
M=/tmp/issue9sa/llama-$PRESET
python3 -m governor.cli make-model "$M" --arch llama --preset $PRESET --no-weights "${MK[@]}" >/dev/null 2>&1
echo "=== compile-check"
TRITON_CACHE_DIR=$(mktemp -d) timeout 120 python3 scripts/compile-check.py "$M" "${CC[@]}" 2>&1 \
  | grep -vE "Writing model shards|Loading|INFO governor" | tee "$BASE/compile-check.txt" | tail -30
echo "=== sweep, async scheduling (default)"
OUT=$BASE/async timeout 260 bash scripts/gpu-issue9-serve.sh
echo "=== sweep, --no-async-scheduling"
OUT=$BASE/sync EXTRA_SERVE=--no-async-scheduling timeout 260 bash scripts/gpu-issue9-serve.sh
