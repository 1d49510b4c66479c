# Sourced by the benchmark suites that run under one deadline (benchmarks/headline.sh, async-scheduling.sh,
# gemv-ab.sh, peers.sh), after they set T0 (start, in $SECONDS), DEADLINE_S, RESULTS_DIR and R (the results folder,
# tarred into $RESULTS_DIR/results.tgz after each stage). `stage NAME MAX_S MIN_S COMMAND...` runs a stage under
# min(MAX_S, time left) and skips it when less than MIN_S is left; `run_py LOG ARGS...` runs python3 ARGS under that
# limit. Sourcing it also opens the run: R is made, everything the suite prints is appended to
# $RESULTS_DIR/run.log as well, and the GPU's identity and the commit go into R.
mkdir -p "$R"
exec > >(tee -a "$RESULTS_DIR/run.log") 2>&1
cp "$RESULTS_DIR/gpu.txt" "$R/" 2>/dev/null || true
git log -1 --format='commit %H' > "$R/commit.txt" 2>/dev/null || true
quiet() { grep -vE "Writing model shards|Loading|INFO governor|it/s\]|Warning: |generation flags" || true; }
FAILED=()
LIMIT=60
stage() {  # stage NAME MAX_S MIN_S COMMAND...: run under min(MAX_S, time left); skip if less than MIN_S is left
  local name=$1 max=$2 min=$3 t0=$SECONDS
  shift 3
  local left=$((DEADLINE_S - (SECONDS - T0)))
  LIMIT=$((left < max ? left : max))
  if [ "$LIMIT" -lt "$min" ]; then
    echo "=== $name: SKIPPED ($left s left of the deadline, needs $min)"; FAILED+=("$name(skipped)"); return
  fi
  echo "=== $name: start $(date -u +%H:%M:%SZ), limit $LIMIT s"
  if "$@"; then echo "=== $name: ok in $((SECONDS - t0)) s"
  else echo "=== $name: FAILED or cut off in $((SECONDS - t0)) s"; FAILED+=("$name"); fi
  tar czf "$RESULTS_DIR/results.tgz" -C "$R" .
}
run_py() {  # run_py LOG ARGS...: python3 ARGS under the stage's limit, output to $R/LOG.log (no pipe to hang on)
  local log=$R/$1.log rc
  shift
  timeout -k 10 "$LIMIT" python3 "$@" >"$log" 2>&1
  rc=$?
  quiet <"$log" | tail -n 45
  [ $rc -eq 0 ] || echo "(exit $rc; 124 = cut off at $LIMIT s)"
  return $rc
}
