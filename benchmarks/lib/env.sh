# Sourced by the benchmarks/*.sh suites and scripts/gpu-tests.sh on a machine with a CUDA GPU: the results folder
# RESULTS_DIR (default out/gpu), wheels from .whl/ if there is one (for a machine without network that lacks a
# package, e.g. pydantic, installed into /tmp/site), PYTHONPATH over the three source roots, and the GPU's identity
# into RESULTS_DIR/gpu.txt.
RESULTS_DIR=${RESULTS_DIR:-out/gpu}
mkdir -p "$RESULTS_DIR"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD/engine:$PWD/kernels:$PWD/operator:/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$RESULTS_DIR/gpu.txt"
