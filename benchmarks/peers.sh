#!/usr/bin/env bash
# The engine beside its peers (vLLM, gpt-fast, transformers) on one GPU, in one run (docs/performance/README.md,
# "Peers"), from the repository root:
#   PEERS_DIR=.peers bash benchmarks/peers.sh     (results under RESULTS_DIR, default out/gpu: summary.txt, results.tgz)
# PEERS_DIR (default .peers) holds what `python3 -m benchmarks.peers.bundle build` made: vllm-1/, vllm-2/, ... (the
# parts of vLLM 0.26.0 and its wheels, unpacked first into PEERS_DIR/site unless it already holds them) and
# gpt-fast/. VLLM_SITE (an unpacked site directory) and GPT_FAST_DIR (a gpt-fast checkout) point elsewhere instead;
# a vLLM installed in the Python itself needs no VLLM_SITE.
# Stages, in this order, under one deadline (DEADLINE_S, default 540 s); each gets min(its limit, what is left) and
# is skipped when too little is left; results land under $RESULTS_DIR as they come:
# 1. models: the qwen3-0.6b shape with random bf16 weights, the llama3-8b shape config-only (as headline.sh).
# 2. throughput: qwen3-0.6b shape, 256 prompts, input 100, output 1024, greedy, ignore_eos: the engine (headline.sh's
#    flags), then vLLM on the same prompt token ids (benchmarks/peers/vllm_throughput.py), then both with an fp8 KV
#    cache.
# 3. latency: llama3-8b shape, batch 1, 512-token context, 128 new tokens: the engine (headline.sh's flags, batch 1
#    only), vLLM (random weights from the same config-only checkpoint), gpt-fast bf16 and int8 weight-only.
# 4. hf-static: transformers generate on the throughput workload, static cache, batch 256 (as headline.sh), last:
#    it is the slowest, and a peer the other pages already quote.
# vLLM's settings (benchmarks/peers/vllm_*.py say more): its defaults and the engine's where both have one
# (max_num_seqs 256, max_num_batched_tokens 8192, gpu_memory_utilization 0.9, max_model_len the checkpoint's for
# throughput and 4096 for latency, as the engine's runs: it sizes block tables only, not compile or capture time),
# with CUDA graphs captured only at the batch sizes the workload reaches (1, 2, 4, ..., 256 for throughput; 1 for
# latency) instead of vLLM's ~50 sizes up to 512: its start-up (torch.compile, then graph capture) is most of a
# vLLM stage. VLLM_USE_FLASHINFER_SAMPLER=0 when flashinfer is absent (the bundle leaves it out).
# DRY=1 runs the same flow on CPU with the tiny preset: the engine's stages run; the peers' runners print their plan
# (vLLM needs CUDA; gpt-fast's modules are imported), and the bundle is unpacked when PEERS_DIR holds one.
set -uo pipefail
T0=$SECONDS
DEADLINE_S=${DEADLINE_S:-540}
. benchmarks/lib/prelude.sh /tmp/peers-dry
. benchmarks/lib/presets.sh
PEERS_DIR=${PEERS_DIR:-.peers}
GPT_FAST_DIR=${GPT_FAST_DIR:-$PEERS_DIR/gpt-fast}
VLLM_SITE=${VLLM_SITE:-}
if [ "${DRY:-0}" = 1 ]; then
  PLAN=(--plan) PEER_LAT=(--context 32 --new-tokens 8) VLLM_LAT=(--dtype float32 --max-model-len 256)
else  # as LAT and LATDEV of lib/presets.sh
  PLAN=() PEER_LAT=(--context 512 --new-tokens 128) VLLM_LAT=(--dtype bfloat16 --max-model-len 4096)
fi
LM=/tmp/peers/llama-$L QM=/tmp/peers/qwen3-$Q R=/tmp/peers/results
. benchmarks/lib/deadline.sh

install_vllm() {  # unpack the bundle into PEERS_DIR/site (a no-op when it holds this bundle already)
  if [ "${DRY:-0}" != 1 ] && ! python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
    echo "the bundle holds wheels for Python 3.12; python3 here is $(python3 -V)"; return 1
  fi
  run_py install -m benchmarks.peers.bundle install --peers-dir "$PEERS_DIR" --target "$PEERS_DIR/site" &&
    VLLM_SITE=$PEERS_DIR/site
}
thr() {  # thr TAG ARGS...: one `bench throughput` of the engine, JSON to $R/thr-TAG.json
  local tag=$1
  shift
  run_py "thr-$tag" -m governor.engine bench throughput --model "$QM" "${W[@]}" "${DEV[@]}" "$@" \
    --output-json "$R/thr-$tag.json" && [ -s "$R/thr-$tag.json" ]
}
latency() {  # the engine's batch-1 latency, JSON to $R/latency-governor.json
  run_py latency-governor -m governor.engine bench latency --model "$LM" --load-format dummy "${LATDEV[@]}" \
    "${LAT[@]}" --batches 1 --output-json "$R/latency-governor.json" && [ -s "$R/latency-governor.json" ]
}
peer() {  # peer TAG MODULE ARGS...: one peer runner (its plan under DRY=1), JSON to $R/TAG.json
  local tag=$1 module=$2
  shift 2
  if [ "${DRY:-0}" = 1 ]; then
    echo "(dry run: $module prints its plan; the peer runs on a GPU only)"
    run_py "$tag" -m "$module" "$@" "${PLAN[@]}"
  else
    run_py "$tag" -m "$module" "$@" --output-json "$R/$tag.json" && [ -s "$R/$tag.json" ]
  fi
}
vllm() {  # vllm TAG MODULE ARGS...: peer with the unpacked bundle first on PYTHONPATH (plans import no vLLM)
  if [ "${DRY:-0}" = 1 ] || [ -z "$VLLM_SITE" ]; then peer "$@"; else PYTHONPATH=$VLLM_SITE:$PYTHONPATH peer "$@"; fi
}
gpt_fast() {  # gpt_fast WEIGHTS
  if [ ! -f "$GPT_FAST_DIR/generate.py" ]; then
    echo "gpt-fast: no checkout at $GPT_FAST_DIR (set GPT_FAST_DIR, or PEERS_DIR to a built bundle)"
    [ "${DRY:-0}" = 1 ]; return
  fi
  peer "latency-gpt-fast-$1" benchmarks.peers.gpt_fast_latency --gpt-fast-dir "$GPT_FAST_DIR" --weights "$1" \
    "${PEER_LAT[@]}"
}

if [ -z "$VLLM_SITE" ] && [ -f "$PEERS_DIR/vllm-1/MANIFEST.sha256" ]; then
  stage install 90 10 install_vllm
elif [ -z "$VLLM_SITE" ]; then
  echo "=== no vLLM bundle under $PEERS_DIR (vllm-1/MANIFEST.sha256) and no VLLM_SITE: vLLM must be importable as is"
fi
stage models 60 10 models
stage throughput 80 40 thr governor
stage vllm-throughput 150 60 vllm thr-vllm benchmarks.peers.vllm_throughput --model "$QM" "${W[@]}"
stage throughput-fp8 80 40 thr governor-fp8 --kv-cache-dtype fp8
stage vllm-throughput-fp8 150 60 vllm thr-vllm-fp8 benchmarks.peers.vllm_throughput --model "$QM" "${W[@]}" \
  --kv-cache-dtype fp8
stage latency 80 30 latency
stage vllm-latency 150 60 vllm latency-vllm benchmarks.peers.vllm_latency --model "$LM" "${PEER_LAT[@]}" \
  "${VLLM_LAT[@]}"
stage gpt-fast-bf16 150 60 gpt_fast bf16
stage gpt-fast-int8 150 60 gpt_fast int8
stage hf-static 160 100 thr hf-static --backend hf --hf-batch-size $HF_BATCH --hf-cache-implementation static \
  --hf-warmup-tokens 32 --hf-progress-every 256

python3 -m benchmarks.peers.summary "$R" | tee "$RESULTS_DIR/summary.txt"
cp "$RESULTS_DIR/summary.txt" "$R/" && tar czf "$RESULTS_DIR/results.tgz" -C "$R" .
echo "total $((SECONDS - T0)) s"
if [ ${#FAILED[@]} -gt 0 ]; then echo "failed or skipped stages: ${FAILED[*]}"; exit 1; fi
