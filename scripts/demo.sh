#!/usr/bin/env bash
# The main job on the embedded default (no cluster, no GPU): generate a small random model, run an
# offline generation and the throughput benchmark, then serve it over the OpenAI API on 127.0.0.1 and
# drive it with the load generator; the server drains and exits on SIGTERM. All on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
OUT=${GOVERNOR_DEMO_DIR:-out/demo}
PORT=${GOVERNOR_DEMO_PORT:-8321}
mkdir -p "$OUT"
governor make-model "$OUT/model" --arch qwen3 --preset small --dtype float32
governor generate --model "$OUT/model" --prompt "The engine keeps a queue of requests and" \
  --prompt "What is a paged KV cache?" --max-tokens 24
governor bench throughput --model "$OUT/model" --num-prompts 32 --input-len 32:256 --output-len 32:128 \
  --max-num-seqs 32 --output-json "$OUT/bench-throughput.json"

governor serve "$OUT/model" --host 127.0.0.1 --port "$PORT" --served-model-name demo --max-num-seqs 16 \
  > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
ready=0
for _ in $(seq 1 120); do
  if curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null; then ready=1; break; fi
  kill -0 $SERVER 2>/dev/null || break
  sleep 0.5
done
if [ $ready != 1 ]; then
  echo "the server did not become ready; its log:" >&2
  cat "$OUT/serve.log" >&2
  exit 1
fi
governor bench serve --base-url "http://127.0.0.1:$PORT" --model demo --num-prompts 48 --request-rate 8 \
  --input-len 32:128 --output-len 16:64 --shared-prefix-len 32 --slo-ttft-ms 2000 --slo-itl-ms 200 \
  --duration 60 --output-json "$OUT/bench-serve.json"
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^governor_(requests_finished_total|prefix_cache_hit_tokens_total)'
kill -TERM $SERVER
wait $SERVER && echo "server drained and exited cleanly"
trap - EXIT
