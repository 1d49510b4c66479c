#!/usr/bin/env bash
# Tensor parallelism on a host with several GPUs (docs/performance/tensor-parallelism.md):
#   bash benchmarks/tensor-parallel.sh
#   or some stages per run: STAGE="tests latency", STAGE=throughput, STAGE=70b.
# Weights are drawn on the GPUs (--load-format dummy) from config-only directories, so nothing big is
# written to disk: a llama3-8b shape at TP 1, 2, 4 (up to the GPU count), then a llama3-70b shape at
# TP 4 (and 8). Each stage runs whether or not an earlier one failed; results are JSON under $RESULTS_DIR.
# DRY=1 runs the same flow on CPU with the tiny preset (to check the script, not to measure).
set -euo pipefail
if [ "${DRY:-0}" = 1 ]; then
  RESULTS_DIR=${RESULTS_DIR:-/tmp/gpu-tp-dry}
  mkdir -p "$RESULTS_DIR"
else
  . benchmarks/lib/env.sh
fi

sizes() { local tp; for tp in "$@"; do if [ "$tp" -le "$NGPU" ]; then printf '%s ' "$tp"; fi; done; }
if [ "${DRY:-0}" = 1 ]; then
  NGPU=2 PRESET8=tiny PRESET70=small DEVICE=(--device cpu --dtype float32) LEN=(--max-model-len 256)
  LAT=(--context 64 --batches 1 --new-tokens 16) THR=(--num-prompts 8 --input-len 16:16 --output-len 16:16)
  LAT70=("${LAT[@]}") THR70=("${THR[@]}") SIZES8="1 2" SIZES70="2"
else
  NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
  PRESET8=llama3-8b PRESET70=llama3-70b DEVICE=(--dtype bfloat16) LEN=(--max-model-len 4096)
  LAT=(--context 512 --batches 1,8 --new-tokens 256) THR=(--num-prompts 256 --input-len 128:128 --output-len 512:512)
  LAT70=(--context 512 --batches 1,8 --new-tokens 128) THR70=("${THR[@]}")
  SIZES8=$(sizes 1 2 4) SIZES70=$(sizes 4 8)  # 70B in bf16 is 141 GB: TP 4 and up on 80 GB cards
fi
M8=/tmp/gpu-tp/$PRESET8 M70=/tmp/gpu-tp/$PRESET70
echo "GPUs: $NGPU; llama3-8b at TP: $SIZES8; llama3-70b at TP: ${SIZES70:-none}" | tee "$RESULTS_DIR/plan.txt"

quiet() { grep -vE "INFO|Writing model shards|Loading" || true; }
gov() { timeout "${STEP_TIMEOUT_S:-540}" python3 -m governor.engine "$@" 2>&1 | quiet; }
config_only() {  # $1 dir, $2 preset: config.json + tokenizer, no weights
  [ -f "$1/config.json" ] || gov make-model "$1" --arch llama --preset "$2" --no-weights --dtype bfloat16
}
. benchmarks/lib/stages.sh

tests() {
  timeout 900 python3 -m pytest -q -m gpu -s tests/test_tensor_parallel.py -p no:cacheprovider 2>&1 \
    | grep -vE "Writing|Loading" | tail -20 | tee "$RESULTS_DIR/gpu-tests.log"
}
bench() {  # bench KIND MODEL_DIR TP TAG ARGS...: one `governor bench KIND` run, JSON to $RESULTS_DIR/KIND-TAG-tpTP.json
  local kind=$1 m=$2 tp=$3 tag=$4
  shift 4
  local json="$RESULTS_DIR/$kind-$tag-tp$tp.json"
  rm -f "$json"
  gov bench "$kind" --model "$m" --load-format dummy --tensor-parallel-size "$tp" "${DEVICE[@]}" "${LEN[@]}" \
    "$@" --output-json "$json" && [ -s "$json" ]
}

for s in ${STAGE:-tests latency throughput 70b}; do
  case $s in
    tests)
      if [ "$NGPU" -ge 2 ]; then stage tests tests; else echo "=== tests: skipped (one GPU)"; fi ;;
    latency)
      stage config-8b config_only $M8 $PRESET8
      for tp in $SIZES8; do stage "latency-8b-tp$tp" bench latency $M8 "$tp" 8b "${LAT[@]}"; done ;;
    throughput)
      stage config-8b config_only $M8 $PRESET8
      for tp in $SIZES8; do stage "throughput-8b-tp$tp" bench throughput $M8 "$tp" 8b "${THR[@]}"; done ;;
    70b)
      stage config-70b config_only $M70 $PRESET70
      for tp in $SIZES70; do
        stage "latency-70b-tp$tp" bench latency $M70 "$tp" 70b "${LAT70[@]}"
        stage "throughput-70b-tp$tp" bench throughput $M70 "$tp" 70b "${THR70[@]}"
      done ;;
    *) echo "unknown stage $s (tests, latency, throughput, 70b)"; FAILED+=("$s") ;;
  esac
done

# One table of every result this run (and earlier runs) left in $RESULTS_DIR.
python3 - "$RESULTS_DIR" <<'EOF' | tee "$RESULTS_DIR/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for f in sorted(out.glob("latency-*-tp*.json")) + sorted(out.glob("throughput-*-tp*.json")):
    env = json.loads(f.read_text())
    r = env["result"]
    if f.name.startswith("latency"):
        line = "; ".join(f"batch {x['batch']}: {x['ms_per_token_p50']:.2f} ms/token p50, TTFT {x['ttft_ms']:.0f} ms"
                         for x in r["rows"])
    else:
        line = (f"{r['output_tokens_per_s']:.0f} output tok/s ({r['total_tokens_per_s']:.0f} total), "
                f"{r['elapsed_s']:.1f} s, {r['kv_blocks_total']} KV blocks, {r['preemptions']} preemptions")
    rows[f.stem] = line
    print(f"{f.stem:24} {line}")
(out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
EOF
if [ ${#FAILED[@]} -gt 0 ]; then echo "failed stages: ${FAILED[*]}"; exit 1; fi
