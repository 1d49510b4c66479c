# Sourced by benchmarks/headline.sh, async-scheduling.sh, peers.sh and engine-ab.sh after lib/prelude.sh: the workloads
# and models they share.
# DRY=1: the tiny preset on CPU (to check a script's flow); otherwise the benchmark shapes of docs/performance/.
#   L, Q: the llama and qwen3 presets; MK: make-model flags; DEV: engine device flags; LATDEV, LAT: bench latency
#   flags and workload; W: the throughput workload (256 prompts, 100 -> 1024 tokens); HF_BATCH: transformers' batch.
if [ "${DRY:-0}" = 1 ]; then
  L=tiny Q=tiny MK=(--dtype float32) DEV=(--device cpu --dtype float32)
  LATDEV=(--device cpu --dtype float32 --max-model-len 256) LAT=(--context 32 --batches 1,2 --new-tokens 8)
  W=(--num-prompts 8 --input-len 10:10 --output-len 12:12) HF_BATCH=8
else
  L=llama3-8b Q=qwen3-0.6b MK=(--dtype bfloat16 --device cuda) DEV=()
  LATDEV=(--dtype bfloat16 --max-model-len 4096) LAT=(--context 512 --batches 1,8,32 --new-tokens 128)
  W=(--num-prompts 256 --input-len 100:100 --output-len 1024:1024) HF_BATCH=256
fi
# models: the llama3-8b shape config-only at $LM (weights drawn by the engine, --load-format dummy) and the qwen3-0.6b
# shape with random weights at $QM, each made once; the suite sets LM and QM, and sources lib/deadline.sh (run_py).
models() {
  [ -f "$LM/config.json" ] || run_py make-llama -m governor.engine make-model "$LM" --arch llama --preset $L \
    --no-weights --dtype bfloat16 || return 1
  [ -f "$QM/config.json" ] || run_py make-qwen -m governor.engine make-model "$QM" --arch qwen3 --preset $Q "${MK[@]}"
}
