#!/usr/bin/env bash
# Quantized weights on one GPU (docs/performance/quantized-weights.md):
#   bash benchmarks/quantized-weights.sh            or some stages: STAGE="tests governor", STAGE=vllm
#   (FORMATS="bf16 gptq", VLLM_FORMATS="bf16 awq", GPT_FAST_WEIGHTS=int4: a stage's formats; BATCHES=1,8,16: the
#   governor stage's decode batches, default 1)
# Batch-1 decode of the llama3-8b shape at a 512-token context, by weight format. Every side draws random weights
# on the GPU from a config-only directory (`governor make-model --no-weights [--quantization awq|gptq|fp8]`, and
# load_format dummy), so nothing big is written or read. Stages:
#   tests     the quantized kernels' and models' GPU tests (GEMVs at real shapes, models under CUDA graphs), first,
#             so that a kernel that does not compute what its reference does is known before it is timed;
#   governor  bf16; fp8 quantized at load (--quantization fp8); block-scaled fp8 (128 x 128); AWQ int4; GPTQ int4
#             (groups of 128): `governor bench latency`, which also reports the weight-read roofline;
#   sweep     each quantized one-row product alone, under launch-policy variants (scripts/quantized-gemv-sweep.py);
#   throughput  offline throughput, 256 prompts of 100 tokens -> 1,024 (greedy, ignore_eos), with fp8 weights
#             (quantized at load from bf16: --quantization fp8 on both sides) and an fp8 KV cache, the engine's and
#             vLLM's on the same prompt token ids, at the qwen3-0.6b shape (random weights on disk) and the llama3-8b
#             shape (load_format dummy); the engine also with bf16 weights and an fp8 KV cache. THR_SHAPES picks
#             shapes (default "qwen3-0.6b llama3-8b");
#   kv        the KV cache the engine sizes with bf16 weights and with fp8 weights quantized at load, each with a
#             bf16 and an fp8 cache (`governor bench kv --weights none,fp8`, short decode and accuracy runs);
#   gpt-fast  int8 and int4 weight-only (benchmarks/peers/gpt_fast_latency.py; GPT_FAST_DIR, default .peers/gpt-fast);
#   vllm      vLLM 0.26 on bf16, block-scaled fp8 and AWQ (VLLM_SITE: an unpacked bundle of benchmarks/peers.sh).
# STAGE's default is "tests governor sweep gpt-fast vllm"; throughput and kv run when named. Each run is its own
# stage (a failure does not stop the others); results are JSON under $RESULTS_DIR.
# DRY=1 runs the governor stage on CPU with the small preset (to check the script, not to measure; the small shape
# has no 128-row blocks, so block-scaled fp8 is left out), and the sweep stage's variants against their references.
set -uo pipefail
if [ "${DRY:-0}" = 1 ]; then
  RESULTS_DIR=${RESULTS_DIR:-/tmp/quant-dry}
  mkdir -p "$RESULTS_DIR"
  export PYTHONPATH=$PWD/engine:$PWD/kernels:$PWD/operator:$PWD PYTHONUNBUFFERED=1
  PRESET=small DEVICE=(--device cpu --dtype float32) LEN=(--max-model-len 256) LAT=(--context 32 --new-tokens 8)
  THR_W=(--num-prompts 4 --input-len 10:10 --output-len 8:8) THR_PRESET=(small small) VLLM_PLAN=(--plan)
  THR_MK=(--dtype float32)
  FORMATS=${FORMATS:-bf16 fp8-online awq gptq}
else
  . benchmarks/lib/env.sh
  PRESET=llama3-8b DEVICE=(--dtype bfloat16) LEN=(--max-model-len 4096) LAT=(--context 512 --new-tokens 128)
  THR_W=(--num-prompts 256 --input-len 100:100 --output-len 1024:1024) THR_PRESET=(qwen3-0.6b llama3-8b) VLLM_PLAN=()
  THR_MK=(--dtype bfloat16 --device cuda)
  FORMATS=${FORMATS:-bf16 fp8-online fp8-block awq gptq}
fi
. benchmarks/lib/stages.sh
BATCHES=${BATCHES:-1}
MAX_SEQS=$(tr , '\n' <<< "$BATCHES" | sort -n | tail -1)
[ "$MAX_SEQS" -ge 8 ] || MAX_SEQS=8
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
    "${LEN[@]}" "${LAT[@]}" --batches "$BATCHES" --max-num-seqs "$MAX_SEQS" "${args[@]:1}" \
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
thr_model() {  # thr_model SHAPE: the throughput checkpoint of a shape (made once, named by its preset), and flags
  local preset dir
  case $1 in
    qwen3-0.6b) preset=${THR_PRESET[0]} dir=/tmp/quant-models/thr-qwen3-${THR_PRESET[0]}
      [ -f "$dir/config.json" ] || python3 -m governor.engine make-model "$dir" --arch qwen3 --preset "$preset" \
        "${THR_MK[@]}" | quiet >&2
      echo "$dir" ;;
    llama3-8b) preset=${THR_PRESET[1]} dir=/tmp/quant-models/thr-llama3-${THR_PRESET[1]}
      [ -f "$dir/config.json" ] || python3 -m governor.engine make-model "$dir" --preset "$preset" --no-weights \
        --dtype bfloat16 | quiet >&2
      echo "$dir --load-format dummy" ;;
    *) echo "unknown throughput shape $1 (qwen3-0.6b or llama3-8b)" >&2; return 1 ;;
  esac
}
throughput_run() {  # throughput_run SHAPE SIDE [WEIGHTS]: SIDE governor|vllm, WEIGHTS fp8 (default) or bf16
  local m weights=${3:-fp8} quant=()
  local tag=$1-$2-$weights
  read -r -a m <<< "$(thr_model "$1")"
  [ ${#m[@]} -gt 0 ] || return 1
  [ "$weights" = fp8 ] && quant=(--quantization fp8)
  rm -f "$RESULTS_DIR/thr-$tag.json"
  if [ "$2" = governor ]; then
    timeout 400 python3 -m governor.engine bench throughput --model "${m[@]}" "${DEVICE[@]}" "${THR_W[@]}" \
      --kv-cache-dtype fp8 "${quant[@]}" --output-json "$RESULTS_DIR/thr-$tag.json" 2>&1 | quiet
  else
    PYTHONPATH=$VLLM_SITE:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 timeout 500 python3 \
      -m benchmarks.peers.vllm_throughput --model "${m[@]}" "${THR_W[@]}" --kv-cache-dtype fp8 "${quant[@]}" \
      "${VLLM_PLAN[@]}" --output-json "$RESULTS_DIR/thr-$tag.json" 2>&1 | quiet
    [ "${DRY:-0}" = 1 ] && return 0  # --plan: the settings printed, nothing run
  fi
  [ -s "$RESULTS_DIR/thr-$tag.json" ]
}
kv_run() {
  rm -f "$RESULTS_DIR/kv-weights.json"
  timeout 400 python3 -m governor.engine bench kv --model "$D/dense" --load-format dummy "${DEVICE[@]}" "${LEN[@]}" \
    --weights none,fp8 --context "${LAT[1]}" --batches 8 --new-tokens 16 --accuracy-tokens 32 \
    --output-json "$RESULTS_DIR/kv-weights.json" 2>&1 | quiet
  [ -s "$RESULTS_DIR/kv-weights.json" ]
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
    throughput) for shape in ${THR_SHAPES:-qwen3-0.6b llama3-8b}; do
        stage "thr-$shape-governor-fp8" throughput_run "$shape" governor
        stage "thr-$shape-governor-bf16" throughput_run "$shape" governor bf16
        stage "thr-$shape-vllm-fp8" throughput_run "$shape" vllm
      done ;;
    kv) stage kv-weights kv_run ;;
    gpt-fast) for w in ${GPT_FAST_WEIGHTS:-int8 int4}; do stage "gpt-fast-$w" gpt_fast_run "$w"; done ;;
    vllm) for f in ${VLLM_FORMATS:-bf16 fp8-block awq}; do stage "vllm-$f" vllm_run "$f"; done ;;
    *) echo "unknown stage $s"; FAILED+=("$s") ;;
  esac
done
if [ ${#FAILED[@]} -gt 0 ]; then echo "failed stages: ${FAILED[*]}"; exit 1; fi
