#!/usr/bin/env bash
# Eighth pass, call 6 (the session's last device time): unsplit fp8 launches of fewer programs with the wide (1-warp)
# and narrow (4-warp) settings, then the throughput target once more (fp8 KV engine, then transformers).
set -uo pipefail
. scripts/gpu-prelude.sh /tmp/e8-dry
. scripts/gpu-issue9-presets.sh
echo "=== ab $(date -u +%T)"
timeout 60 python3 scripts/decode-attention-ab.py "$OUT/ab-wide.json" --rounds 2 --groups fp8 --cases 48,64,128,160,192,256 \
  > "$OUT/ab-wide.txt" 2>&1; tail -1 "$OUT/ab-wide.txt"
timeout 40 python3 -m governor.engine make-model /tmp/q3 --arch qwen3 --preset qwen3-0.6b --dtype bfloat16 --device cuda 2>&1 | tail -1
for b in governor hf; do
  echo "=== $b $(date -u +%T)"
  extra=(--kv-cache-dtype fp8)
  [ $b = hf ] && extra=(--backend hf --hf-batch-size 256 --hf-cache-implementation static --hf-warmup-tokens 32 --hf-progress-every 256)
  timeout 130 python3 -m governor.engine bench throughput --model /tmp/q3 "${W[@]}" "${extra[@]}" \
    --output-json "$OUT/thr-$b.json" > "$OUT/thr-$b.log" 2>&1
  python3 -c "import json; r=json.load(open('$OUT/thr-$b.json'))['result']; print('$b', round(r['output_tokens_per_s']), 'tok/s', round(r['elapsed_s'], 2), 's')"
done
