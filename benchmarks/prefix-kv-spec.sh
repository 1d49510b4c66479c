#!/usr/bin/env bash
# The prefix cache, the fp8 KV cache and speculative decoding on one GPU (docs/performance/prefix-cache.md,
# fp8-kv-cache.md, speculative-decoding.md), one stage or several per run:
#   STAGE=tests|prefix|kv|spec|spec-draft|align bash benchmarks/prefix-kv-spec.sh   (default "tests prefix kv";
#   results under RESULTS_DIR, default out/gpu)
set -uo pipefail
. benchmarks/lib/env.sh
M=/tmp/llama3-8b
make_8b() { [ -f $M/config.json ] || python3 -m governor.engine make-model $M --arch llama --preset llama3-8b \
  --dtype bfloat16 --device cuda 2>&1 | grep -v INFO; }
for stage in ${STAGE:-tests prefix kv}; do
  case $stage in
    tests)
      python3 -m pytest -q -m gpu -s tests/ -p no:cacheprovider --ignore=tests/test_server.py --ignore=tests/test_server_schema.py --ignore=tests/test_server_spec_and_salt.py 2>&1 | grep -vE "Writing|Loading" | tail -40 \
        | tee "$RESULTS_DIR/gpu-tests.log" ;;
    prefix)
      make_8b
      python3 -m governor.engine bench prefix --model $M --system-len 2000 --suffix-len 50 --concurrency 1,32 \
        --divergence-prompts 32 --divergence-tokens 64 --output-json "$RESULTS_DIR/bench-prefix.json" 2>&1 | grep -v INFO ;;
    kv)
      make_8b
      python3 -m governor.engine bench kv --model $M --context 4096 --batches 32,128 --new-tokens 64 \
        --accuracy-prompt-len 64 --accuracy-tokens 256 --output-json "$RESULTS_DIR/bench-kv.json" 2>&1 | grep -v INFO ;;
  esac
done
# Speculative decoding sweep: STAGE=spec
if [[ " ${STAGE:-} " == *" spec "* ]]; then
  Q=/tmp/qwen3-0.6b
  [ -f $Q/config.json ] || python3 -m governor.engine make-model $Q --arch qwen3 --preset qwen3-0.6b \
    --dtype bfloat16 --device cuda 2>&1 | grep -v INFO
  python3 -m governor.engine bench spec --model $Q --batches 1,8,64 --ks 1,2,4,8 --input-len 32 \
    --output-len 64 --perturb-sigma 0.05 --ngram --output-json "$RESULTS_DIR/bench-spec.json" 2>&1 \
    | grep -v INFO | tail -5
fi
# A cheap draft at the llama3-8b shape (a llama3.2-1b shape of the same vocabulary), acceptance 0.8 set by each
# engine, the engine's and vLLM's in one run: STAGE=spec-draft (VLLM_SITE: an unpacked bundle of benchmarks/peers.sh)
if [[ " ${STAGE:-} " == *" spec-draft "* ]]; then
  T=/tmp/m8 D=/tmp/llama3.2-1b SPEC=(--batches 1,8 --ks 2,4 --input-len 32 --output-len 128)
  # DRAFT_QUANTIZATION=fp8: the draft quantized at load on both sides (its decoder linears in e4m3)
  [ -n "${DRAFT_QUANTIZATION:-}" ] && SPEC+=(--draft-quantization "$DRAFT_QUANTIZATION")
  TAG=${DRAFT_QUANTIZATION:+-$DRAFT_QUANTIZATION}
  [ -f $T/config.json ] || python3 -m governor.engine make-model $T --arch llama --preset llama3-8b --no-weights \
    --dtype bfloat16 2>&1 | grep -v INFO
  [ -f $D/config.json ] || python3 -m governor.engine make-model $D --arch llama --preset llama3.2-1b \
    --dtype bfloat16 --device cuda 2>&1 | grep -v INFO
  python3 -m governor.engine bench spec --model $T --load-format dummy --dtype bfloat16 --max-model-len 4096 \
    "${SPEC[@]}" --perturb-sigma "" --no-equal-draft --draft-model $D --draft-acceptance 0.8 \
    --output-json "$RESULTS_DIR/bench-spec-draft$TAG.json" 2>&1 | grep -v INFO | tail -5
  PYTHONPATH=${VLLM_SITE:-}:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m benchmarks.peers.vllm_spec --model $T \
    --draft-model $D "${SPEC[@]}" --draft-acceptance 0.8 --output-json "$RESULTS_DIR/spec-vllm$TAG.json" 2>&1 \
    | grep -E '^\{' | tail -6
fi
# Hit-vs-cold divergence with prefill chunks aligned to blocks and not: STAGE=align
if [[ " ${STAGE:-} " == *" align "* ]]; then
  make_8b
  for a in align-prefill-chunks no-align-prefill-chunks; do
    python3 -m governor.engine bench prefix --model $M --system-len 2000 --suffix-len 50 --concurrency 1 \
      --divergence-prompts 16 --divergence-tokens 64 --max-num-batched-tokens 500 --$a \
      --output-json "$RESULTS_DIR/bench-prefix-$a.json" 2>&1 | grep -v INFO
  done
fi
