# Sourced first by the deadline-driven suites (benchmarks/headline.sh, async-scheduling.sh, gemv-ab.sh, peers.sh)
# as `. benchmarks/lib/prelude.sh DRY_DIR`: with DRY=1 (a CPU check of the suite's flow) RESULTS_DIR defaults to
# DRY_DIR and the Triton kernels run interpreted; otherwise the GPU machine's set-up (benchmarks/lib/env.sh) and the
# software versions, appended to $RESULTS_DIR/gpu.txt.
if [ "${DRY:-0}" = 1 ]; then
  RESULTS_DIR=${RESULTS_DIR:-$1}
  mkdir -p "$RESULTS_DIR"
  export PYTHONPATH=$PWD/engine:$PWD/kernels:$PWD/operator:$PWD PYTHONUNBUFFERED=1 TRITON_INTERPRET=1
else
  . benchmarks/lib/env.sh
  python3 -c "import torch, triton, transformers, platform; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, 'python', \
platform.python_version())" | tee -a "$RESULTS_DIR/gpu.txt"
fi
