# Sourced first by the deadline-driven GPU scripts (scripts/gpu-issue9-measure.sh, gpu-issue9-fused.sh,
# gpu-issue9-async.sh) as `. scripts/gpu-prelude.sh DRY_OUT`: with DRY=1 (a CPU check of the script's flow)
# OUT defaults to DRY_OUT and the Triton kernels run interpreted; otherwise the GPU machine's set-up
# (scripts/gpu-env.sh) and the software versions, appended to $OUT/gpu.txt.
if [ "${DRY:-0}" = 1 ]; then
  OUT=${OUT:-$1}
  mkdir -p "$OUT"
  export PYTHONPATH=$PWD/engine:$PWD/kernels:$PWD/operator:$PWD PYTHONUNBUFFERED=1 TRITON_INTERPRET=1
else
  . scripts/gpu-env.sh
  python3 -c "import torch, triton, transformers, platform; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, 'python', \
platform.python_version())" | tee -a "$OUT/gpu.txt"
fi
