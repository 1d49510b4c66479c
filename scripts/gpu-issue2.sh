#!/usr/bin/env bash
# GPU checks and the throughput benchmark of issue 2, run on the GPU machine through the device tool:
#   run(command="bash scripts/gpu-issue2.sh", carry=[".whl"])
# .whl holds pydantic wheels for the GPU machine's Python (it lacks pydantic); everything else is there.
set -uo pipefail
. scripts/gpu-env.sh
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -m gpu -s tests/ -p no:cacheprovider --ignore=tests/test_server.py --ignore=tests/test_server_schema.py --ignore=tests/test_server_spec_and_salt.py 2>&1 | tail -40 | tee "$OUT/gpu-tests.log"
fi
M=/tmp/qwen3-0.6b
python3 -m governor.engine make-model $M --arch qwen3 --preset qwen3-0.6b --dtype bfloat16 --device cuda
W="--num-prompts 256 --input-len 100:1024 --output-len 100:1024"
python3 -m governor.engine bench throughput --model $M $W --output-json "$OUT/bench-governor.json" 2>&1 | grep -v INFO
for bs in ${HF_BATCHES:-256 64}; do
  timeout 240 python3 -m governor.engine bench throughput --model $M $W --backend hf --hf-batch-size "$bs" \
    --output-json "$OUT/bench-hf-$bs.json" 2>&1 | grep -vE "INFO|Loading|Warning|warn"
done
