#!/usr/bin/env bash
# Quantized weights on one GPU (docs/performance/quantized-weights.md):
#   bash benchmarks/quantized-weights.sh            or some stages: STAGE="tests governor", STAGE=vllm
#   (FORMATS="bf16 gptq": the governor stage's formats)
# Batch-1 decode of the llama3-8b shape at a 512-token context, by weight format. Every side draws random weights
# on the GPU from a config-only directory (`governor make-model --no-weights [--quantization awq|gptq|fp8]`, and
# load_format dummy), so nothing big is written or read. Stages:
#   tests     the quantized kernels' and models' GPU tests (GEMVs at real shapes, models under CUDA graphs), first,
#             so that a kernel that does not compute what its reference does is known before it is timed;
#   governor  bf16; fp8 quantized at load (--quantization fp8); block-scaled fp8 (128 x 128); AWQ int4; GPTQ int4
#             (groups of 128): `governor bench latency`, which also reports the weight-read roofline;
#   sweep     each quantized one-row product alone, under launch-policy variants (scripts/quantized-gemv-sweep.py);
#   gpt-fast  int8 and int4 weight-only (benchmarks/peers/gpt_fast_latency.py; GPT_FAST_DIR, default .peers/gpt-fast);
#   vllm      vLLM 0.26 on bf16, block-scaled fp8 and AWQ (VLLM_SITE: an unpacked bundle of benchmarks/peers.sh).
# Each run is its own stage (a failure does not stop the others); results are JSON under $RESULTS_DIR.
# DRY=1 runs the governor stage on CPU with the small preset (to check the script, not to measure; the small shape
# has no 128-row blocks, so block-scaled fp8 is left out), and the sweep stage's variants against their references.
set -uo pipefail
if [ "${DRY:-0}" = 1 ]; then
  RESULTS_DIR=${RESULTS_DIR:-/tmp/quant-dry}
  mkdir -p "$RESULTS_DIR"
  export PYTHONPATH=$PWD/engine:$PWD/kernels:$PWD/operator:$PWD PYTHONUNBUFFERED=1
  PRESET=small DEVICE=(--device cpu --dtype float32) LEN=(--max-model-len 256) LAT=(--context 32 --new-tokens 8)
  FORMATS=${FORMATS:-bf16 fp8-online awq gptq}
else
  . benchmarks/lib/env.sh
  PRESET=llama3-8b DEVICE=(--dtype bfloat16) LEN=(--max-model-len 4096) LAT=(--context 512 --new-tokens 128)
  FORMATS=${FORMATS:-bf16 fp8-online fp8-block awq gptq}
fi
. benchmarks/lib/stages.sh
D=/tmp/quant-models/$PRESET
GPT_FAST_DIR=${GPT_FAST_DIR:-.peers/gpt-fast}
VLLM_SITE=${VLLM_SITE:-}
quiet() { grep -vE "INFO|WARNING" | tail -4 || true; }

config_only() {  # config_only NAME [awq|gptq|fp8]
  [ -f "$D/$1/config.json" ] || python3 -m governor.engine make-model "$D/$1" --preset "$PRESET" --no-weights \
    --dtype bfloat16 ${2:+--quantization "$2"} | quiet
}
dir_of() {  # the config directory of a format, and what the engine is told beside it
  case $1 in
    bf16) echo dense ;; fp8-online) echo dense --quantization fp8 ;; fp8-block) echo fp8 ;; *) echo "$1" ;;
  esac
}
governor_run() {  # governor_run FORMAT
  local args
  read -r -a args <<< "$(dir_of "$1")"
  rm -f "$RESULTS_DIR/lat-governor-$1.json"  # a file left by an earlier run must not pass for this one
  timeout 400 python3 -m governor.engine bench latency --model "$D/${args[0]}" --load-format dummy "${DEVICE[@]}" \
    "${LEN[@]}" "${LAT[@]}" --batches 1 --max-num-seqs 8 "${args[@]:1}" \
    --output-json "$RESULTS_DIR/lat-governor-$1.json" 2>&1 | quiet
  [ -s "$RESULTS_DIR/lat-governor-$1.json" ]
}
gpu_tests() {
  timeout 900 python3 -m pytest -q -m gpu tests/test_kernels_gemv.py tests/test_kernels_fp8_quant.py \
    tests/test_kernels_packed_gemm.py tests/test_kernels_packed_gemv.py tests/test_quantized_weights.py -p no:cacheprovider 2>&1 | tail -15 | tee "$RESULTS_DIR/gpu-tests.log"
  [ "${PIPESTATUS[0]}" = 0 ]
}
sweep_run() {
  rm -f "$RESULTS_DIR/gemv-sweep.json"
  if [ "${DRY:-0}" = 1 ]; then  # every variant against its reference, interpreted
    TRITON_INTERPRET=1 python3 scripts/quantized-gemv-sweep.py --check --output-json "$RESULTS_DIR/gemv-sweep.json" \
      2>&1 | tail -2
  else
    timeout 400 python3 scripts/quantized-gemv-sweep.py --deadline-s 300 --output-json "$RESULTS_DIR/gemv-sweep.json" \
      2>&1 | tail -2
  fi
  [ -s "$RESULTS_DIR/gemv-sweep.json" ]
}
gpt_fast_run() {  # gpt_fast_run int8|int4
  rm -f "$RESULTS_DIR/lat-gpt-fast-$1.json"
  timeout 500 python3 -m benchmarks.peers.gpt_fast_latency --gpt-fast-dir "$GPT_FAST_DIR" --weights "$1" \
    "${LAT[@]}" --output-json "$RESULTS_DIR/lat-gpt-fast-$1.json" 2>&1 | quiet
  [ -s "$RESULTS_DIR/lat-gpt-fast-$1.json" ]
}
vllm_run() {  # vllm_run FORMAT
  local args
  read -r -a args <<< "$(dir_of "$1")"
  rm -f "$RESULTS_DIR/lat-vllm-$1.json"
  PYTHONPATH=$VLLM_SITE:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 timeout 500 python3 -m benchmarks.peers.vllm_latency \
    --model "$D/${args[0]}" "${LAT[@]}" "${args[@]:1}" --output-json "$RESULTS_DIR/lat-vllm-$1.json" 2>&1 | quiet
  [ -s "$RESULTS_DIR/lat-vllm-$1.json" ]
}

for spec in "dense" "awq awq" "gptq gptq" "fp8 fp8"; do config_only $spec; done
for s in ${STAGE:-tests governor sweep gpt-fast vllm}; do
  case $s in
    tests) stage gpu-tests gpu_tests ;;
    governor) for f in $FORMATS; do stage "governor-$f" governor_run "$f"; done ;;
    sweep) stage gemv-sweep sweep_run ;;
    gpt-fast) for w in int8 int4; do stage "gpt-fast-$w" gpt_fast_run "$w"; done ;;
    vllm) for f in bf16 fp8-block awq; do stage "vllm-$f" vllm_run "$f"; done ;;
    *) echo "unknown stage $s"; FAILED+=("$s") ;;
  esac
done
if [ ${#FAILED[@]} -gt 0 ]; then echo "failed stages: ${FAILED[*]}"; exit 1; fi
