#!/usr/bin/env bash
# Eighth pass, call 5 (it ran on call 4's machine, still warm): the throughput target again (fp8 KV engine, then transformers), then the
# engine's GPU tests (its start now runs the budget warm-up) while time is left.
set -uo pipefail
T0=$SECONDS
. scripts/gpu-prelude.sh /tmp/e8-dry
. scripts/gpu-issue9-presets.sh
timeout 90 python3 -m governor.engine make-model /tmp/q3 --arch qwen3 --preset qwen3-0.6b --dtype bfloat16 --device cuda 2>&1 | tail -1
for b in governor hf; do
  echo "=== $b $(date -u +%T)"
  extra=(--kv-cache-dtype fp8)
  [ $b = hf ] && extra=(--backend hf --hf-batch-size 256 --hf-cache-implementation static --hf-warmup-tokens 32 --hf-progress-every 256)
  timeout 200 python3 -m governor.engine bench throughput --model /tmp/q3 "${W[@]}" "${extra[@]}" \
    --output-json "$OUT/thr-$b.json" > "$OUT/thr-$b.log" 2>&1
  python3 -c "import json; r=json.load(open('$OUT/thr-$b.json'))['result']; print('$b', round(r['output_tokens_per_s']), 'tok/s', round(r['elapsed_s'], 2), 's')"
done
LEFT=$((570 - (SECONDS - T0)))
echo "=== gpu tests $(date -u +%T), $LEFT s left"
timeout $LEFT python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_engine_gpu.py 2>&1 | tail -4
echo "total $((SECONDS - T0)) s"
