#!/usr/bin/env bash
# Batch-1 decode with other GEMV launch configurations, end to end, on one GPU:
#   bash benchmarks/gemv-config-ab.sh        (CONFIGS="4 2048 4;4 1024 4" ROUNDS=2 to choose)
# Copies this tree once per configuration in CONFIGS ("block_n block_k num_warps", the first is the default), with
# the launch policy's `gemv` (kernels/governor/kernels/launch_policy.py) set to it, then runs `governor bench
# latency` (llama3-8b shape, dummy bf16 weights, 512-token context, batch 1, CUDA graphs) of each in turn,
# ROUNDS times, alternating, and prints the ms/token p50, the GPU time of the step and the roofline fraction.
set -uo pipefail
. benchmarks/lib/env.sh
CONFIGS=${CONFIGS:-"4 1024 4;4 2048 4;4 2048 8"}
ROUNDS=${ROUNDS:-2}
M=/tmp/gemv-ab/llama3-8b
python3 -m governor.engine make-model "$M" --arch llama --preset llama3-8b --no-weights --dtype bfloat16 >/dev/null
IFS=';' read -r -a CFGS <<<"$CONFIGS"
for i in "${!CFGS[@]}"; do
  read -r bn bk w <<<"${CFGS[$i]}"
  t=/tmp/gemv-ab/tree$i
  rm -rf "$t" && mkdir -p "$t" && cp -r engine kernels operator "$t/"
  cfg="GemvConfig(block_n=$bn, block_k=$bk, num_warps=$w)"
  sed -i "s/^    gemv: GemvConfig = GemvConfig([^)]*)/    gemv: GemvConfig = $cfg/" \
    "$t/kernels/governor/kernels/launch_policy.py"
  grep -qF "gemv: GemvConfig = $cfg" "$t/kernels/governor/kernels/launch_policy.py" ||
    { echo "sed failed"; exit 1; }
done
for r in $(seq 1 "$ROUNDS"); do
  for i in "${!CFGS[@]}"; do
    t=/tmp/gemv-ab/tree$i
    echo "--- round $r, GEMV ${CFGS[$i]}"
    PYTHONPATH=$t/engine:$t/kernels:$t/operator:/tmp/site timeout 120 python3 -m governor.engine bench latency \
      --model "$M" --load-format dummy --dtype bfloat16 --max-model-len 4096 --context 512 --batches 1 \
      --new-tokens 128 2>&1 | grep -E "batch 1 at|GPU time"
  done
done
