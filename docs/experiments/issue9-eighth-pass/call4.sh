#!/usr/bin/env bash
# Eighth pass, call 4: the first-run cost after the budget warm-up (one engine, two runs, step times), then the issue 9
# targets (throughput bf16/fp8, transformers, latency, attention) on the final code.
set -uo pipefail
T0=$SECONDS
. scripts/gpu-prelude.sh /tmp/e8-dry
D=docs/experiments/issue9-eighth-pass
timeout 90 python3 -m governor.engine make-model /tmp/q3 --arch qwen3 --preset qwen3-0.6b --dtype bfloat16 --device cuda 2>&1 | tail -1
echo "=== thr $(date -u +%T)"
timeout 120 python3 $D/thr_ab.py /tmp/q3 "$OUT/thr-ab.json" --rounds 2 --variants '{"new": {}}' 2>&1 | grep -v "INFO\|Warning" | tail -4
python3 - "$OUT/thr-ab.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
a, b = rows[0]["step_s"], rows[1]["step_s"]
n = min(len(a), len(b))
d = [x - y for x, y in zip(a[:n], b[:n])]
print(f"run 0 {sum(a):.3f} s, run 1 {sum(b):.3f} s over {len(a)}/{len(b)} steps; "
      f"diff first 10 steps {sum(d[:10]):.3f} s, rest {sum(d[10:]):.3f} s")
print("first 5 steps ms run0/run1:", ", ".join(f"{1e3*a[i]:.1f}/{1e3*b[i]:.1f}" for i in range(5)))
PY
echo "=== targets $(date -u +%T)"
DEADLINE_S=$((575 - (SECONDS - T0))) bash scripts/gpu-issue9-targets.sh > "$OUT/targets.txt" 2>&1
tail -16 "$OUT/targets.txt"
grep "kernels of prefill\|CUDA graphs:" /tmp/issue9t/results/thr-async-fp8.log | head -3
echo "total $((SECONDS - T0)) s"
