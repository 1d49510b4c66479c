#!/usr/bin/env bash
# Does streaming a chunk per token (bench serve --return-token-ids) cost serving throughput? One `governor serve`
# of the llama3-8b shape (as scripts/gpu-issue9-serve.sh), then `governor bench serve` at concurrency 64 with and
# without --return-token-ids, alternating, twice each. Device tool: run(command="bash scripts/gpu-issue9-serve-ab.sh",
# carry=[".whl"]) (the wheels gpu-issue9-serve.sh lists).
set -uo pipefail
. scripts/gpu-env.sh >/dev/null
M=/tmp/ab/llama3-8b; PORT=18001
python3 -m governor.cli make-model $M --arch llama --preset llama3-8b --no-weights --dtype bfloat16 >/dev/null 2>&1
python3 -m governor.cli serve $M --load-format dummy --dtype bfloat16 --max-model-len 4096 --served-model-name bench --host 127.0.0.1 --port $PORT >$OUT/server.log 2>&1 &
S=$!
for _ in $(seq 1 300); do curl -sf http://127.0.0.1:$PORT/ready >/dev/null && break; sleep 1; done
for rep in 1 2; do for flag in "" "--return-token-ids"; do
  echo "== rep $rep flag '${flag:-none}'"
  timeout 100 python3 -m governor.cli bench serve --base-url http://127.0.0.1:$PORT --model bench --max-concurrency 64 --num-prompts 256 --input-len 512 --output-len 128 --ignore-eos --seed 0 --duration 60 $flag 2>&1 | grep -E "Output token throughput|Duration|ITL p50|TTFT p50|timed at"
done; done
kill $S 2>/dev/null || true
