#!/usr/bin/env bash
# Serving sweep on one GPU (docs/performance/serving.md):
#   bash benchmarks/serving-sweep.sh        (results under RESULTS_DIR, default out/gpu)
# On a machine without network whose Python lacks them, put wheels in `.whl/` (git-ignored; lib/env.sh installs
# them): pydantic and, for the server and the load generator, fastapi, starlette, uvicorn, h11, anyio, sniffio,
# click, httpx, httpcore, certifi, idna, typing_extensions (`pip download --no-deps --only-binary=:all:
# --python-version 3.12 -d .whl <name>==<version as in .venv>`).
# One `governor serve` of the llama3-8b shape (random bf16 weights drawn on the GPU, CUDA graphs on, every
# other setting default), then `governor bench serve` at max concurrency 1, 16, 64 and 256 (closed loop:
# requests sent back to back up to that many in flight), 512-word prompts, 128 output tokens, ignore_eos,
# return_token_ids (so the client times every token: most of a random model's ids decode to no text).
# EXTRA_SERVE adds `governor serve` flags (e.g. --no-async-scheduling); LEVELS_ONLY="16 64" with
# PROMPTS_ONLY="96 256" runs only those levels.
# DRY=1 runs the same flow on CPU with the tiny preset (to check the script, not to measure).
set -uo pipefail
if [ "${DRY:-0}" = 1 ]; then
  RESULTS_DIR=${RESULTS_DIR:-/tmp/gpu-serve-dry}; mkdir -p "$RESULTS_DIR"
  PRESET=tiny SERVE=(--device cpu --dtype float32 --max-model-len 256) IN=16 NEW_TOKENS=8 LEVELS=(1 4) PROMPTS=(4 8)
else
  . benchmarks/lib/env.sh
  PRESET=llama3-8b SERVE=(--load-format dummy --dtype bfloat16 --max-model-len 4096) IN=512 NEW_TOKENS=128
  LEVELS=(1 16 64 256) PROMPTS=(16 96 256 512)
fi
if [ -n "${LEVELS_ONLY:-}" ]; then
  read -r -a LEVELS <<<"$LEVELS_ONLY"
  read -r -a PROMPTS <<<"$PROMPTS_ONLY"
fi
. benchmarks/lib/stages.sh
M=/tmp/gpu-serve/$PRESET
PORT=18000
gov() { python3 -m governor.cli "$@"; }
if [ "${DRY:-0}" = 1 ]; then
  gov make-model "$M" --arch llama --preset "$PRESET" >/dev/null 2>&1
else
  gov make-model "$M" --arch llama --preset "$PRESET" --no-weights --dtype bfloat16 >/dev/null 2>&1
fi
# shellcheck disable=SC2086  # EXTRA_SERVE is a list of flags
python3 -m governor.cli serve "$M" "${SERVE[@]}" ${EXTRA_SERVE:-} --served-model-name bench --host 127.0.0.1 --port $PORT >"$RESULTS_DIR/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { echo "server exited"; tail -30 "$RESULTS_DIR/server.log"; exit 1; }
  sleep 1
done
grep -E "CUDA graphs|KV cache" "$RESULTS_DIR/server.log" | tail -3
# The engine's own latency histograms over one level (TTFT to the first token, ITL between tokens), to set
# beside the client's (which adds HTTP, SSE and the client's own time).
engine_side() {  # engine_side LABEL COMMAND...: run COMMAND, then print the engine's p50/p95 over it
  local label=$1; shift
  python3 - "$PORT" "$label" "$@" <<'PY'
import json, subprocess, sys
from governor import contract
from governor.tuner.scrape import EngineScraper, buckets_of, histogram_quantile
port, label, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
scraper = EngineScraper([f"http://127.0.0.1:{port}"], scrape_interval_s=10.0)
before = scraper.scrape()
subprocess.run(cmd, check=False)
after = scraper.scrape()
s = scraper.signals(before, after)
ttft = [buckets_of(snap.engines[0].metrics or {}, contract.TTFT_SECONDS) for snap in (before, after)]
ttft_p50 = histogram_quantile(0.5, *ttft)  # Signals carry TTFT p95 only
print(json.dumps({"level": label, "engine_ttft_p50_ms": ttft_p50 and ttft_p50 * 1e3,
                  "engine_ttft_p95_ms": s.ttft_p95_s and s.ttft_p95_s * 1e3,
                  "engine_itl_p50_ms": s.itl_p50_s and s.itl_p50_s * 1e3,
                  "engine_itl_p95_ms": s.itl_p95_s and s.itl_p95_s * 1e3,
                  "engine_e2e_p95_ms": s.e2e_p95_s and s.e2e_p95_s * 1e3}))
PY
}
sweep() {
  local i c
  for i in "${!LEVELS[@]}"; do
    c=${LEVELS[$i]}
    engine_side "c$c" timeout 150 python3 -m governor.cli bench serve --base-url "http://127.0.0.1:$PORT" \
      --model bench --max-concurrency "$c" --num-prompts "${PROMPTS[$i]}" --input-len "$IN" \
      --output-len "$NEW_TOKENS" --ignore-eos --return-token-ids --seed 0 --duration 90 \
      --output-json "$RESULTS_DIR/serve-c$c.json" 2>&1 | grep -vE '^\{"completed' | tail -27 | tee "$RESULTS_DIR/serve-c$c.txt"
  done
}
stage sweep sweep
echo "failed stages: ${FAILED[*]:-none}"
