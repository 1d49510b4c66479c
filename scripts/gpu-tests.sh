#!/usr/bin/env bash
# The GPU tests (marked `gpu`, skipped without CUDA) on a machine with a CUDA GPU:
#   bash scripts/gpu-tests.sh        (log under RESULTS_DIR, default out/gpu)
# Every single-GPU test file with GPU tests, then the tensor-parallel ones when the machine has two GPUs or more.
# The operator's and tuner's test modules are left out: they need packages (kopf, fastapi, ...) that a GPU machine
# set up for the engine may lack, and they have no GPU tests.
set -uo pipefail
. benchmarks/lib/env.sh
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)" | tee -a "$RESULTS_DIR/gpu.txt"
FILES=(tests/test_async_scheduling.py tests/test_bench_attention.py tests/test_cuda_graphs.py tests/test_engine_gpu.py
       tests/test_kernels_elementwise.py tests/test_kernels_fp8_quant.py tests/test_kernels_gemv.py
       tests/test_kernels_packed_gemm.py tests/test_kernels_packed_gemv.py tests/test_kernels_paged_attention.py
       tests/test_quantized_weights.py
       tests/test_step_fast_paths.py tests/test_structured_outputs.py)
python3 -m pytest -q -m gpu -p no:cacheprovider -rs "${FILES[@]}" 2>&1 | grep -vE "Writing|Loading" | tail -40 \
  | tee "$RESULTS_DIR/gpu-tests.log"
rc=${PIPESTATUS[0]}
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_tensor_parallel.py tests/test_tensor_parallel_gpu.py 2>&1 \
    | tail -20 \
    | tee -a "$RESULTS_DIR/gpu-tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
exit "$rc"
