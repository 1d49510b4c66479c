#!/usr/bin/env bash
# Tensor parallelism on a host with several GPUs (docs/performance/tensor-parallelism.md):
#   bash benchmarks/tensor-parallel.sh
#   or some stages per run: STAGE="tests allreduce latency", STAGE=throughput, STAGE=70b, STAGE=vllm.
# Weights are drawn on the GPUs (--load-format dummy) from config-only directories, so nothing big is
# written to disk. Stages:
#   tests       the tensor-parallel GPU tests (2 and 4 GPUs);
#   allreduce   `bench all-reduce`: one all-reduce's time by size and path, at TP 2 and 4 (the per-step share of
#               the roofline, and the thresholds of tp/all_reduce.py);
#   latency     llama3-8b shape, 512-token context, batches 1, 8, 32, at TP 1, 2, 4; TP 2 again with every
#               all-reduce on NCCL (--disable-custom-all-reduce) and eagerly (--enforce-eager);
#   profile     where a batch-1 decode step's time goes at TP 1, 2, 4: its graph replayed by every rank in lockstep
#               against the runner and the engine stepping it (scripts/profile-tp-step.py); rank 0's eager kernels
#               by name (scripts/profile-decode.py); the one-row GEMV on each rank's shard of the products
#               (scripts/gemv-sweep.py --tp);
#   shards      one GPU suffices: one rank's share of the llama3-8b shape at TP 2 and 4 as a dense model
#               (scripts/tp-shard-config.py) decoded at batch 1 on one GPU, beside the whole model: a rank's step
#               without the all-reduces and the other ranks; the same step anatomy; the GEMV on the shards' shapes;
#   shards-ab   BASE=<commit> (a git worktree of it) or BASE_TREE=<folder> (e.g. from `git archive`, where the copy
#               has no .git): latency of the llama3-8b shape and its TP 2 and 4 shards on one GPU by that code and by
#               this tree, alternated (ROUNDS, default 2): a kernel change's effect per shard;
#   tp-ab       the same comparison on real tensor parallelism: latency of the llama3-8b shape at TP 1, 2 (and 4
#               where the host has 4 GPUs; AB_TP to choose) by that code and by this tree, alternated;
#   throughput  llama3-8b shape at TP 2: 256 prompts, 100 tokens in, 1024 out;
#   70b         llama3-70b shape at TP 4: latency at batches 1, 8, 32, and the throughput workload;
#   vllm        vLLM 0.26 on the same shapes and workloads at the same TP sizes (PEERS_DIR holds its bundle, as
#               benchmarks/peers.sh; VLLM_SITE an unpacked one).
# Each stage runs whether or not an earlier one failed; results are JSON under $RESULTS_DIR.
# DRY=1 runs the same flow on CPU with the tiny preset (to check the script, not to measure).
set -uo pipefail
if [ "${DRY:-0}" = 1 ]; then
  RESULTS_DIR=${RESULTS_DIR:-/tmp/gpu-tp-dry}
  mkdir -p "$RESULTS_DIR"
  export PYTHONPATH=$PWD/engine:$PWD/kernels:$PWD/operator:$PWD PYTHONUNBUFFERED=1
else
  . benchmarks/lib/env.sh
fi

sizes() { local tp; for tp in "$@"; do if [ "$tp" -le "$NGPU" ]; then printf '%s ' "$tp"; fi; done; }
if [ "${DRY:-0}" = 1 ]; then
  NGPU=2 PRESET8=tiny PRESET70=small DEVICE=(--device cpu --dtype float32) LEN=(--max-model-len 256)
  LAT=(--context 64 --batches 1,2 --new-tokens 16) THR=(--num-prompts 8 --input-len 16:16 --output-len 16:16)
  LAT70=("${LAT[@]}") THR70=("${THR[@]}") SIZES8="1 2" SIZES70="2" SHARDS=2 VLLM_THR=(--max-model-len 256)
  PROF=(--context 32 --steps 3 load_format=dummy device=cpu dtype=float32 max_model_len=256)
  ANATOMY=(--context 32 --steps 5 load_format=dummy device=cpu dtype=float32 max_model_len=256)
  LAT_AB=(--context 64 --batches 1 --new-tokens 16)
else
  NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
  PRESET8=llama3-8b PRESET70=llama3-70b DEVICE=(--dtype bfloat16) LEN=(--max-model-len 4096)
  LAT=(--context 512 --batches 1,8,32 --new-tokens 128)
  THR=(--num-prompts 256 --input-len 100:100 --output-len 1024:1024)
  LAT70=("${LAT[@]}") THR70=("${THR[@]}") VLLM_THR=(--max-model-len 4096)
  PROF=(--context 512 --steps 20 load_format=dummy dtype=bfloat16 max_model_len=4096 max_num_seqs=8)
  ANATOMY=(--context 512 --steps 200 load_format=dummy dtype=bfloat16 max_model_len=4096 max_num_seqs=8)
  LAT_AB=(--context 512 --batches 1,8 --new-tokens 64)
  SIZES8=$(sizes 1 2 4) SIZES70=$(sizes 4) SHARDS="2 4"  # 70B in bf16 is 141 GB: TP 4 on 80 GB cards
fi
PEERS_DIR=${PEERS_DIR:-.peers}
VLLM_SITE=${VLLM_SITE:-}
M8=/tmp/gpu-tp/$PRESET8 M70=/tmp/gpu-tp/$PRESET70
echo "GPUs: $NGPU; llama3-8b at TP: $SIZES8; llama3-70b at TP: ${SIZES70:-none}" | tee "$RESULTS_DIR/plan.txt"

quiet() { grep -vE "INFO|Writing model shards|Loading" || true; }
gov() { timeout "${STEP_TIMEOUT_S:-540}" python3 -m governor.engine "$@" 2>&1 | quiet; }
config_only() {  # $1 dir, $2 preset: config.json + tokenizer, no weights
  [ -f "$1/config.json" ] || gov make-model "$1" --arch llama --preset "$2" --no-weights --dtype bfloat16
}
. benchmarks/lib/stages.sh

tests() {
  timeout 900 python3 -m pytest -q -m gpu -s tests/test_tensor_parallel.py tests/test_tensor_parallel_gpu.py \
    -p no:cacheprovider 2>&1 | grep -vE "Writing|Loading" | tail -30 | tee "$RESULTS_DIR/gpu-tests.log"
  [ "${PIPESTATUS[0]}" = 0 ]
}
bench() {  # bench KIND MODEL_DIR TP TAG ARGS...: one `governor bench KIND` run, JSON to $RESULTS_DIR/KIND-TAG-tpTP.json
  local kind=$1 m=$2 tp=$3 tag=$4
  shift 4
  local json="$RESULTS_DIR/$kind-$tag-tp$tp.json"
  rm -f "$json"
  gov bench "$kind" --model "$m" --load-format dummy --tensor-parallel-size "$tp" "${DEVICE[@]}" "${LEN[@]}" \
    "$@" --output-json "$json" && [ -s "$json" ]
}
all_reduce() {  # all_reduce TP: `bench all-reduce`, JSON to $RESULTS_DIR/allreduce-tpTP.json
  gov bench all-reduce --tp "$1" --output-json "$RESULTS_DIR/allreduce-tp$1.json" && [ -s "$RESULTS_DIR/allreduce-tp$1.json" ]
}
make_worktree() {  # make_worktree DIR COMMIT: a git worktree of COMMIT at DIR
  [ -n "$2" ] || { echo "BASE=<commit> or BASE_TREE=<folder> names the code to compare"; return 1; }
  rm -rf "$1" && git worktree prune && git worktree add -q --detach "$1" "$2"
}
ab_sides() {  # SIDES: "base new", or "new" when there is no base tree; BASE_DIR: the base tree
  BASE_DIR=${BASE_TREE:-/tmp/gpu-tp/base}
  SIDES="base new"
  if [ -z "${BASE_TREE:-}" ]; then stage base-tree make_worktree "$BASE_DIR" "${BASE:-}"; fi
  [ -d "$BASE_DIR/kernels/governor" ] || SIDES=new
}
side_path() {  # side_path base|new: the PYTHONPATH that runs that side's code
  local tree=$PWD
  [ "$1" = base ] && tree=$BASE_DIR
  echo "$tree/engine:$tree/kernels:$tree/operator:$PYTHONPATH"
}
install_vllm() {  # unpack the bundle into PEERS_DIR/site (a no-op when it holds this bundle already)
  python3 -m benchmarks.peers.bundle install --peers-dir "$PEERS_DIR" --target "$PEERS_DIR/site" &&
    VLLM_SITE=$PEERS_DIR/site
}
vllm() {  # vllm TAG MODULE ARGS...: one vLLM runner, JSON to $RESULTS_DIR/TAG.json (its plan under DRY=1)
  local tag=$1 module=$2
  shift 2
  if [ "${DRY:-0}" = 1 ]; then python3 -m "$module" "$@" --plan; return; fi
  rm -f "$RESULTS_DIR/$tag.json"
  PYTHONPATH=${VLLM_SITE:+$VLLM_SITE:}$PYTHONPATH timeout "${STEP_TIMEOUT_S:-540}" python3 -m "$module" "$@" \
    --output-json "$RESULTS_DIR/$tag.json" 2>&1 | grep -vE "^INFO|it/s\]" | tail -20
  [ -s "$RESULTS_DIR/$tag.json" ]
}

for s in ${STAGE:-tests allreduce latency profile throughput 70b vllm}; do
  case $s in
    tests)
      if [ "$NGPU" -ge 2 ]; then stage tests tests; else echo "=== tests: skipped (one GPU)"; fi ;;
    allreduce)
      if [ "${DRY:-0}" = 1 ]; then echo "=== allreduce: skipped (needs GPUs)"; continue; fi
      for tp in $(sizes 2 4); do stage "allreduce-tp$tp" all_reduce "$tp"; done ;;
    latency)
      stage config-8b config_only $M8 $PRESET8
      for tp in $SIZES8; do stage "latency-8b-tp$tp" bench latency $M8 "$tp" 8b "${LAT[@]}"; done
      if [ "${DRY:-0}" != 1 ] && [ "$NGPU" -ge 2 ]; then
        stage latency-8b-nccl-tp2 bench latency $M8 2 8b-nccl "${LAT[@]}" --disable-custom-all-reduce
        stage latency-8b-eager-tp2 bench latency $M8 2 8b-eager "${LAT[@]}" --enforce-eager
      fi ;;
    profile)
      stage config-8b config_only $M8 $PRESET8
      for tp in ${PROFILE_TP:-$SIZES8}; do
        stage "anatomy-8b-tp$tp" timeout "${STEP_TIMEOUT_S:-540}" python3 scripts/profile-tp-step.py $M8 \
          "$RESULTS_DIR/anatomy-8b-tp$tp.json" --tp "$tp" --batch 1 "${ANATOMY[@]}"
        stage "profile-8b-tp$tp" timeout "${STEP_TIMEOUT_S:-540}" python3 scripts/profile-decode.py $M8 \
          "$RESULTS_DIR/profile-8b-tp$tp.json" --batch 1 "${PROF[@]}" enforce_eager=true tensor_parallel_size="$tp"
        if [ "${DRY:-0}" != 1 ] && [ "$tp" -gt 1 ]; then
          stage "gemv-tp$tp" timeout 300 python3 scripts/gemv-sweep.py --tp "$tp" --deadline-s "${GEMV_SWEEP_S:-120}" \
            --output-json "$RESULTS_DIR/gemv-tp$tp.json"
        fi
      done ;;
    shards)
      stage config-8b config_only $M8 $PRESET8
      stage latency-8b-tp1 bench latency $M8 1 8b "${LAT[@]}"
      for n in $SHARDS; do
        stage "config-8b-shard$n" python3 scripts/tp-shard-config.py $M8 "$M8-shard$n" "$n"
        stage "latency-8b-shard$n" bench latency "$M8-shard$n" 1 "8b-shard$n" "${LAT[@]}"
      done
      for m in 8b $(printf '8b-shard%s ' $SHARDS); do
        d=$M8${m#8b}
        stage "anatomy-$m-tp1" timeout "${STEP_TIMEOUT_S:-540}" python3 scripts/profile-tp-step.py "$d" \
          "$RESULTS_DIR/anatomy-$m-tp1.json" --tp 1 --batch 1 "${ANATOMY[@]}"
      done
      if [ "${DRY:-0}" != 1 ]; then
        for n in $SHARDS; do
          stage "gemv-tp$n" timeout 300 python3 scripts/gemv-sweep.py --tp "$n" --deadline-s "${GEMV_SWEEP_S:-120}" \
            --output-json "$RESULTS_DIR/gemv-tp$n.json"
        done
      fi ;;
    shards-ab)
      stage config-8b config_only $M8 $PRESET8
      for n in $SHARDS; do stage "config-8b-shard$n" python3 scripts/tp-shard-config.py $M8 "$M8-shard$n" "$n"; done
      ab_sides
      for r in $(seq "${ROUNDS:-2}"); do
        for side in $SIDES; do
          for m in 8b $(printf '8b-shard%s ' $SHARDS); do
            PYTHONPATH=$(side_path $side) stage "ab-$m-$side-$r" bench latency "$M8${m#8b}" 1 "ab-$m-$side-$r" \
              "${LAT_AB[@]}"
          done
        done
      done ;;
    tp-ab)
      stage config-8b config_only $M8 $PRESET8
      ab_sides
      for r in $(seq "${ROUNDS:-2}"); do
        for side in $SIDES; do
          for tp in ${AB_TP:-$SIZES8}; do
            PYTHONPATH=$(side_path $side) stage "tp-ab-$side-$r-tp$tp" bench latency $M8 "$tp" "8b-ab-$side-$r" \
              "${LAT_AB[@]}"
          done
        done
      done ;;
    throughput)
      stage config-8b config_only $M8 $PRESET8
      stage throughput-8b-tp2 bench throughput $M8 2 8b "${THR[@]}" ;;
    70b)
      stage config-70b config_only $M70 $PRESET70
      for tp in $SIZES70; do
        stage "latency-70b-tp$tp" bench latency $M70 "$tp" 70b "${LAT70[@]}"
        stage "throughput-70b-tp$tp" bench throughput $M70 "$tp" 70b "${THR70[@]}"
      done ;;
    vllm)
      if [ -z "$VLLM_SITE" ] && [ -f "$PEERS_DIR/vllm-1/MANIFEST.sha256" ] && [ "${DRY:-0}" != 1 ]; then
        stage install-vllm install_vllm
      fi
      stage config-8b config_only $M8 $PRESET8
      for tp in $(sizes 2 4); do
        stage "vllm-latency-8b-tp$tp" vllm "vllm-latency-8b-tp$tp" benchmarks.peers.vllm_latency --model $M8 \
          --context 512 --new-tokens 128 --tensor-parallel-size "$tp"
      done
      stage vllm-throughput-8b-tp2 vllm vllm-throughput-8b-tp2 benchmarks.peers.vllm_throughput --model $M8 \
        --load-format dummy --num-prompts 256 --input-len 100:100 --output-len 1024:1024 "${VLLM_THR[@]}" \
        --tensor-parallel-size 2
      for tp in $SIZES70; do
        stage config-70b config_only $M70 $PRESET70
        stage "vllm-throughput-70b-tp$tp" vllm "vllm-throughput-70b-tp$tp" benchmarks.peers.vllm_throughput \
          --model $M70 --load-format dummy --num-prompts 256 --input-len 100:100 --output-len 1024:1024 \
          "${VLLM_THR[@]}" --tensor-parallel-size "$tp"
      done ;;
    *) echo "unknown stage $s (tests, allreduce, latency, profile, shards, shards-ab, tp-ab, throughput, 70b, vllm)"; FAILED+=("$s") ;;
  esac
done

# One table of every result this run (and earlier runs) left in $RESULTS_DIR.
python3 -m benchmarks.tp_summary "$RESULTS_DIR" | tee "$RESULTS_DIR/summary.txt"
if [ ${#FAILED[@]} -gt 0 ]; then echo "failed stages: ${FAILED[*]}"; exit 1; fi
