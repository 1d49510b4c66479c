#!/usr/bin/env bash
# What penalties and structured outputs cost per output token on one GPU (docs/performance/sampling.md): decode
# latency at batch 1 and 64, plain vs --penalties vs --structured json, on the qwen3-0.6b shape (151,936-token
# vocabulary: the widest mask) and the llama3-8b shape; then the CUDA tests of both features. Results under
# RESULTS_DIR (default out/gpu); PRESETS="qwen3-0.6b:qwen3" for one shape.
set -uo pipefail
. benchmarks/lib/env.sh
for preset in ${PRESETS:-qwen3-0.6b:qwen3 llama3-8b:llama}; do
  name=${preset%%:*} arch=${preset##*:} M=/tmp/$name
  [ -f $M/config.json ] || python3 -m governor.engine make-model $M --arch $arch --preset $name --dtype bfloat16 \
    --device cuda 2>&1 | grep -v INFO
  for opt in plain penalties structured; do
    flags=""
    [ $opt = penalties ] && flags="--penalties"
    [ $opt = structured ] && flags="--structured json"
    python3 -m governor.engine bench latency --model $M --context 512 --batches 1,64 --new-tokens 64 $flags \
      --output-json "$RESULTS_DIR/sampling-$name-$opt.json" 2>&1 | grep -v INFO | tail -4
  done
done
python3 -m pytest -q -p no:cacheprovider tests/test_structured_outputs.py tests/test_sampling_processors.py 2>&1 \
  | grep -vE "Writing|Loading" | tail -8 | tee "$RESULTS_DIR/sampling-tests.log"
