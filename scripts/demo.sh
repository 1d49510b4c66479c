#!/usr/bin/env bash
# The main job on the embedded default (no cluster, no GPU): generate a small random model,
# run an offline generation, then the throughput benchmark, all on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
OUT=${GOVERNOR_DEMO_DIR:-out/demo}
mkdir -p "$OUT"
governor make-model "$OUT/model" --arch qwen3 --preset small --dtype float32
governor generate --model "$OUT/model" --prompt "The engine keeps a queue of requests and" \
  --prompt "What is a paged KV cache?" --max-tokens 24
governor bench throughput --model "$OUT/model" --num-prompts 32 --input-len 32:256 --output-len 32:128 \
  --max-num-seqs 32 --output-json "$OUT/bench-throughput.json"
