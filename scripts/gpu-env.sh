# Sourced by the scripts/gpu-*.sh runs on the GPU machine: $OUT, carried wheels (.whl: pydantic for
# the machine's Python, which lacks it), PYTHONPATH over the three source roots, and the GPU's identity.
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD/engine:$PWD/kernels:$PWD/operator:/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
