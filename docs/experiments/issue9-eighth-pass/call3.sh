#!/usr/bin/env bash
# Eighth pass, call 3: offline throughput, old (4-warp) and new (1-warp) unsplit fp8 launches, alternating engines in
# one process, two runs each with per-step wall times; transformers' baseline (static cache, batch 256) after.
set -uo pipefail
T0=$SECONDS
. scripts/gpu-prelude.sh /tmp/e8-dry
D=docs/experiments/issue9-eighth-pass
OLD='{"_DECODE_UNSPLIT_NUM_WARPS_FP8": 4, "_DECODE_UNSPLIT_TILE_N_FP8": 128, "_DECODE_UNSPLIT_MAXNREG_FP8": 128}'
echo "=== model $(date -u +%T)"
timeout 90 python3 -m governor.engine make-model /tmp/q3 --arch qwen3 --preset qwen3-0.6b --dtype bfloat16 --device cuda 2>&1 | tail -1
echo "=== thr $(date -u +%T)"
timeout 260 python3 $D/thr_ab.py /tmp/q3 "$OUT/thr-ab.json" --rounds 2 \
  --variants "{\"old\": $OLD, \"new\": {}, \"old#2\": $OLD, \"new#2\": {}}" 2>&1 | grep -v "INFO\|Warning" | tail -10
python3 - "$OUT/thr-ab.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
a, b = rows[0]["step_s"], rows[1]["step_s"]
n = min(len(a), len(b))
d = [x - y for x, y in zip(a[:n], b[:n])]
print(f"first engine: run 0 {sum(a):.3f} s, run 1 {sum(b):.3f} s over {len(a)}/{len(b)} steps; "
      f"diff first 10 steps {sum(d[:10]):.3f} s, rest {sum(d[10:]):.3f} s")
top = sorted(range(n), key=lambda i: -d[i])[:12]
print("largest step diffs (index: run0 ms / run1 ms):", ", ".join(f"{i}: {1e3*a[i]:.1f}/{1e3*b[i]:.1f}" for i in top))
PY
echo "=== hf $(date -u +%T)"
timeout 200 python3 -m governor.engine bench throughput --model /tmp/q3 --num-prompts 256 --input-len 100:100 \
  --output-len 1024:1024 --backend hf --hf-batch-size 256 --hf-cache-implementation static --hf-warmup-tokens 32 \
  --hf-progress-every 256 --output-json "$OUT/thr-hf-static-256.json" > "$OUT/hf.log" 2>&1
python3 -c "import json; r=json.load(open('$OUT/thr-hf-static-256.json'))['result']; print('hf', round(r['output_tokens_per_s']), 'tok/s', round(r['elapsed_s'], 2), 's')"
echo "total $((SECONDS - T0)) s"
