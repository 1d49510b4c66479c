# Sourced by the benchmark suites that run without one deadline (benchmarks/*.sh): `stage NAME COMMAND...` runs one
# stage, prints its time, and records a failure in FAILED without stopping the script (the later stages still run).
FAILED=()
stage() {  # stage NAME COMMAND...: run, time, and record a failure without stopping the script
  local name=$1 t0=$SECONDS
  shift
  echo "=== $name: start $(date -u +%H:%M:%SZ)"
  if "$@"; then echo "=== $name: ok in $((SECONDS - t0)) s"
  else echo "=== $name: FAILED in $((SECONDS - t0)) s"; FAILED+=("$name"); fi
}
