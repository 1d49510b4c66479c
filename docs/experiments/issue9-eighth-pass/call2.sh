#!/usr/bin/env bash
# Eighth pass, call 2: fp8 split-launch settings A/B (all shapes), the issue 9 targets on the code with 1-warp unsplit
# fp8 launches, then the GPU tests of the kernel and engine.
set -uo pipefail
T0=$SECONDS
. scripts/gpu-prelude.sh /tmp/e8-dry
echo "=== ab $(date -u +%T)"
timeout 200 python3 scripts/decode-attention-ab.py "$OUT/ab-split.json" --rounds 2 --groups fp8 > "$OUT/ab-split.txt" 2>&1
tail -3 "$OUT/ab-split.txt"
echo "=== targets $(date -u +%T)"
DEADLINE_S=$((560 - (SECONDS - T0) - 110)) bash scripts/gpu-issue9-targets.sh > "$OUT/targets.txt" 2>&1
tail -25 "$OUT/targets.txt"
LEFT=$((585 - (SECONDS - T0)))
echo "=== gpu tests $(date -u +%T), $LEFT s left"
timeout $LEFT python3 -m pytest -q -p no:cacheprovider tests/test_kernels_paged_attention.py tests/test_fp8_kv.py \
  tests/test_engine_gpu.py tests/test_cuda_graphs.py -m "gpu or not gpu" -k "gpu or fp8_decode_launches" 2>&1 | tail -6
echo "total $((SECONDS - T0)) s"
