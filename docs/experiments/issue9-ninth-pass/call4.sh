#!/usr/bin/env bash
# Ninth pass, call 4 (after call 3, on its machine when still warm): the throughput target's fp8 engine twice more
# in fresh processes and transformers once more, then the first and second runs in one process (step times).
set -uo pipefail
T0=$SECONDS
. scripts/gpu-prelude.sh /tmp/e9-dry
. scripts/gpu-issue9-presets.sh
exec > >(tee -a "$OUT/run.log") 2>&1
D=docs/experiments/issue9-ninth-pass
[ -f /tmp/q3/config.json ] || timeout 60 python3 -m governor.engine make-model /tmp/q3 --arch qwen3 --preset qwen3-0.6b \
  --dtype bfloat16 --device cuda 2>&1 | tail -1
n=0
for b in governor governor hf; do
  n=$((n + 1)); echo "=== $b ($n) $(date -u +%T)"
  extra=(--kv-cache-dtype fp8)
  [ $b = hf ] && extra=(--backend hf --hf-batch-size 256 --hf-cache-implementation static --hf-warmup-tokens 32 --hf-progress-every 256)
  timeout 130 python3 -m governor.engine bench throughput --model /tmp/q3 "${W[@]}" "${extra[@]}" \
    --output-json "$OUT/thr-$b-$n.json" > "$OUT/thr-$b-$n.log" 2>&1
  python3 -c "import json; r=json.load(open('$OUT/thr-$b-$n.json'))['result']; print('$b', round(r['output_tokens_per_s']), 'tok/s', round(r['elapsed_s'], 2), 's')"
done
echo "=== first run $(date -u +%T)"
timeout 150 python3 $D/first_run.py /tmp/q3 "$OUT/first-run.json" > "$OUT/first-run.log" 2>&1
grep -v "INFO\|Warning" "$OUT/first-run.log" | tail -8
echo "total $((SECONDS - T0)) s"
