#!/usr/bin/env bash
# Serving with and without async scheduling, alternated to separate the difference from run-to-run spread: four
# `governor serve` processes of the llama3-8b shape (as benchmarks/serving-sweep.sh), in the order one step at a
# time, async, one step at a time, async; against each, `governor bench serve` at concurrency 16 (96 prompts) and
# 64 (256 prompts), twice each, 512-word prompts, 128 output tokens, every token timed, on one GPU:
#   bash benchmarks/serving-async-ab.sh        (needs the serving wheels of benchmarks/serving-sweep.sh)
# DRY=1 checks the flow on CPU with the tiny preset.
set -uo pipefail
if [ "${DRY:-0}" = 1 ]; then
  RESULTS_DIR=${RESULTS_DIR:-/tmp/ab-dry}; mkdir -p "$RESULTS_DIR"
  export PYTHONPATH=$PWD/engine:$PWD/kernels:$PWD/operator:$PWD PYTHONUNBUFFERED=1
  PRESET=tiny SERVE=(--device cpu --dtype float32 --max-model-len 256 --load-format dummy) IN=16 NEW_TOKENS=8 MK=()
else
  . benchmarks/lib/env.sh >/dev/null
  PRESET=llama3-8b SERVE=(--load-format dummy --dtype bfloat16 --max-model-len 4096) IN=512 NEW_TOKENS=128
  MK=(--dtype bfloat16)
fi
M=/tmp/abs/llama-$PRESET PORT=18002
python3 -m governor.cli make-model "$M" --arch llama --preset $PRESET --no-weights "${MK[@]}" >/dev/null 2>&1
round=0
for mode in --no-async-scheduling --async-scheduling --no-async-scheduling --async-scheduling; do
  round=$((round + 1))
  python3 -m governor.cli serve "$M" "${SERVE[@]}" $mode --served-model-name bench --host 127.0.0.1 --port $PORT \
    >"$RESULTS_DIR/server-$round.log" 2>&1 &
  S=$!
  for _ in $(seq 1 300); do
    curl -sf http://127.0.0.1:$PORT/ready >/dev/null && break
    kill -0 $S 2>/dev/null || { echo "server exited"; tail -5 "$RESULTS_DIR/server-$round.log"; exit 1; }
    sleep 1
  done
  for c in 16 64; do
    n=$([ $c = 16 ] && echo 96 || echo 256)
    for rep in 1 2; do
      printf '%s c=%s rep %s: ' "$mode" "$c" "$rep"
      timeout 100 python3 -m governor.cli bench serve --base-url http://127.0.0.1:$PORT --model bench \
        --max-concurrency $c --num-prompts $n --input-len $IN --output-len $NEW_TOKENS --ignore-eos --return-token-ids \
        --seed $rep --duration 60 2>&1 | grep -E "Output token throughput|TTFT p50|ITL p50|Failed requests" \
        | awk '{print $NF}' | paste -sd' ' | sed 's/^/failed tok\/s TTFTp50 ITLp50 = /'
    done
  done
  kill $S 2>/dev/null || true
  wait $S 2>/dev/null || true
done
