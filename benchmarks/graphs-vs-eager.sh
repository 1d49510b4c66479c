#!/usr/bin/env bash
# Decode steps with CUDA graphs against eager mode on one GPU (docs/performance/step-overhead.md):
#   bash benchmarks/graphs-vs-eager.sh        (or STAGE="tests", "latency", "profile"; results under RESULTS_DIR)
# tests: the GPU tests of graphs against eager (and the engine's GPU tests, which now run with graphs).
# latency: `governor bench latency` on a llama3-8b shape (random weights drawn on the GPU from a
# config-only directory), 512-token context, batch 1/8/32, with CUDA graphs and with --enforce-eager;
# each run also measures HBM bandwidth (device-to-device copy) for the memory roofline.
# profile: CUDA kernel time by kernel of batch-1 decode steps (scripts/profile-decode.py), graphs and eager.
# Each stage runs whether or not an earlier one failed; results land under $RESULTS_DIR.
# DRY=1 runs the same flow on CPU with the tiny preset (to check the script, not to measure).
set -uo pipefail
if [ "${DRY:-0}" = 1 ]; then
  RESULTS_DIR=${RESULTS_DIR:-/tmp/gpu-graphs-dry}
  mkdir -p "$RESULTS_DIR"
  PRESET=tiny DEVICE=(--device cpu --dtype float32 --max-model-len 256) LAT=(--context 32 --batches 1,2 --new-tokens 8)
  PROF=(--context 32 --steps 3 load_format=dummy device=cpu dtype=float32 max_model_len=256)
else
  . benchmarks/lib/env.sh
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', \
triton.__version__)" | tee -a "$RESULTS_DIR/gpu.txt"
  PRESET=llama3-8b DEVICE=(--dtype bfloat16 --max-model-len 4096) LAT=(--context 512 --batches 1,8,32 --new-tokens 128)
  PROF=(--context 512 --steps 20 load_format=dummy dtype=bfloat16 max_model_len=4096)
fi
M=/tmp/gpu-graphs/$PRESET
quiet() { grep -vE "Writing model shards|Loading|INFO governor.engine: (KV|model)" || true; }
. benchmarks/lib/stages.sh

tests() {
  timeout "${TESTS_TIMEOUT_S:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs --durations=8 \
    tests/test_cuda_graphs.py tests/test_engine_gpu.py tests/test_kernels_paged_attention.py 2>&1 \
    | grep -vE "Writing|Loading" | tail -40 | tee "$RESULTS_DIR/gpu-tests.log"
  return "${PIPESTATUS[0]}"
}
spec_tests() {
  timeout "${SPEC_TESTS_TIMEOUT_S:-150}" python3 -m pytest -q -x -p no:cacheprovider tests/test_spec_decode.py 2>&1 \
    | grep -vE "Writing|Loading" | tail -15 | tee "$RESULTS_DIR/gpu-spec-tests.log"
  return "${PIPESTATUS[0]}"
}
config_only() {
  [ -f "$M/config.json" ] || python3 -m governor.engine make-model "$M" --arch llama --preset $PRESET --no-weights \
    --dtype bfloat16 2>&1 | quiet
}
latency() {  # latency TAG ARGS...: JSON to $RESULTS_DIR/latency-TAG.json
  local tag=$1
  shift
  timeout "${STEP_TIMEOUT_S:-240}" python3 -m governor.engine bench latency --model "$M" --load-format dummy \
    "${DEVICE[@]}" "${LAT[@]}" "$@" --output-json "$RESULTS_DIR/latency-$tag.json" 2>&1 \
    | quiet | tee "$RESULTS_DIR/latency-$tag.log"
  [ -s "$RESULTS_DIR/latency-$tag.json" ]
}

profile() {  # profile TAG ENGINE_ARGS...: JSON to $RESULTS_DIR/profile-TAG.json
  local tag=$1
  shift
  timeout "${STEP_TIMEOUT_S:-240}" python3 scripts/profile-decode.py "$M" "$RESULTS_DIR/profile-$tag.json" --batch 1 \
    "${PROF[@]}" "$@" 2>&1 | quiet
  [ -s "$RESULTS_DIR/profile-$tag.json" ]
}

for s in ${STAGE:-tests latency profile}; do
  case $s in
    tests) if [ "${DRY:-0}" = 1 ]; then echo "=== tests: skipped (dry run)"; else stage tests tests; fi ;;
    latency)
      stage config config_only
      stage latency-graphs latency graphs
      stage latency-eager latency eager --enforce-eager ;;
    spec-tests)  # the CPU speculative-decoding tests, here on the GPU (device auto) with graphs
      stage spec-tests spec_tests ;;
    profile)  # kernel time by kernel of batch-1 decode steps, graphs and eager
      stage config config_only
      stage profile-graphs profile graphs
      stage profile-eager profile eager enforce_eager=true ;;
    *) echo "unknown stage $s (tests, latency, profile, spec-tests)"; FAILED+=("$s") ;;
  esac
done

python3 - "$RESULTS_DIR" <<'EOF' | tee "$RESULTS_DIR/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for tag in ("graphs", "eager"):
    f = out / f"latency-{tag}.json"
    if not f.exists():
        continue
    r = json.loads(f.read_text())["result"]
    e = r["engine"]
    print(f"{tag}: cuda_graphs={e['cuda_graphs']} captures={e['cuda_graph_captures']} "
          f"capture_s={e['cuda_graph_capture_s']:.2f} hbm_copy_gb_per_s={e.get('hbm_copy_gb_per_s', 0):.0f} "
          f"weight_bytes={e.get('decode_weight_bytes', 0)}")
    for x in r["rows"]:
        print(f"  batch {x['batch']}: {x['ms_per_token_p50']:.2f} ms/token p50 (mean {x['ms_per_token_mean']:.2f}, "
              f"p90 {x['ms_per_token_p90']:.2f}), GPU {x.get('forward_ms_p50', 0):.2f} ms, "
              f"roofline {x.get('roofline_ms', 0):.2f} ms = {100 * x.get('roofline_fraction_p50', 0):.0f}%, "
              f"TTFT {x['ttft_ms']:.0f} ms, {x['decode_tok_s']:.0f} tok/s")
EOF
if [ ${#FAILED[@]} -gt 0 ]; then echo "failed stages: ${FAILED[*]}"; exit 1; fi
