#!/usr/bin/env bash
# Eighth pass, call 1: unsplit fp8 launch settings (attention A/B), then the throughput A/B (the best of them and
# block-table packing on/off, one process), then the GPU tests of the commits not yet run on a GPU.
set -uo pipefail
T0=$SECONDS
. scripts/gpu-prelude.sh /tmp/e8-dry
exec > >(tee -a "$OUT/run.log") 2>&1
D=docs/experiments/issue9-eighth-pass
echo "=== ab $(date -u +%T)"
timeout 170 python3 scripts/decode-attention-ab.py "$OUT/ab-unsplit.json" --rounds 2 --groups fp8 --cases 256,32
VARIANTS=$(python3 - "$OUT/ab-unsplit.json" <<'PY'
import json, sys, collections
rows = json.load(open(sys.argv[1]))["rows"]
t = collections.defaultdict(list)
for r in rows:
    if r["case"].startswith("b256"):
        t[r["variant"]].append(r["us_p50"])
mean = {k: sum(v) / len(v) for k, v in t.items() if v}
best = min(mean, key=mean.get)
print("mean b256 us:", {k: round(v, 1) for k, v in mean.items()}, file=sys.stderr)
import importlib.util
spec = importlib.util.spec_from_file_location("ab", "scripts/decode-attention-ab.py")
ab = importlib.util.module_from_spec(spec); spec.loader.exec_module(ab)
v = {"cur": {}}
if best != "cur":
    v[best] = ab.GROUPS["fp8"][best]
print(json.dumps(v))
PY
)
echo "variants: $VARIANTS"
echo "=== model $(date -u +%T)"
timeout 90 python3 -m governor.engine make-model /tmp/q3 --arch qwen3 --preset qwen3-0.6b --dtype bfloat16 --device cuda 2>&1 | tail -2
echo "=== thr $(date -u +%T)"
timeout 230 python3 $D/thr_ab.py /tmp/q3 "$OUT/thr-ab.json" --rounds 2 --variants "$VARIANTS" 2>&1 | grep -v "INFO\|Warning" | tail -12
LEFT=$((585 - (SECONDS - T0)))
echo "=== gpu tests $(date -u +%T), $LEFT s left"
timeout $LEFT python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_bench_attention.py tests/test_step_fast_paths.py \
  tests/test_kernels_paged_attention.py tests/test_kernels_elementwise.py tests/test_engine_gpu.py tests/test_cuda_graphs.py \
  tests/test_async_scheduling.py tests/test_fp8_kv.py 2>&1 | tail -15
echo "total $((SECONDS - T0)) s"
