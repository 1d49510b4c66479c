set -u
S="--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section MemoryWorkloadAnalysis --section LaunchStats --section ComputeWorkloadAnalysis"
run() {  # tag args...
  local tag=$1; shift
  timeout 120 ncu $S -k regex:_decode_kernel --launch-skip 2 --launch-count 1 python3 docs/experiments/issue9-sixth-pass/ncu_target.py "$@" > $OUT/ncu-$tag.txt 2>&1
  echo "== $tag rc=$?"; grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Issued Ipc|No Eligible|Active Warps Per|Eligible Warps|Warp Cycles Per Issued|Block Limit" $OUT/ncu-$tag.txt | head -20
}
run fp8-32k landed 32 32768 32 8 fp8
run vt168-32k vt 32 32768 32 8 fp8
