#!/usr/bin/env bash
# Runs on the GPU machine after ../shared/tools/device-pack: ncu's speed-of-light, occupancy,
# scheduler, warp-state and source-counter sections for one layer's decode kernels (q/k/v,
# attention (v3, or v2 and its merge), o, gate/up, down) in an eager decode step of the
# Qwen2.5-3B shape after a 48-token prompt. Prints the lines worth reading; the whole report
# goes to $OUT.
# Usage: bash tests/gpu/profile-kernels.sh
set -uo pipefail
out=${OUT:-device-logs}; mkdir -p "$out"
export DV2_CACHE_DIR=/tmp/dv2-cache
export LD_LIBRARY_PATH="$PWD/.device/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 400 "$ncu" --section SpeedOfLight --section Occupancy --section SchedulerStats \
  --section WarpStateStats --section SourceCounters --section LaunchStats \
  --kernel-name regex:'gemv3_|gemv2_swiglu|gemv2_nf4_j3|attn2_|attn3_' \
  --launch-skip 1000 --launch-count 6 .device/examples/bench --decode-profile 6 > "$out/ncu-kernels.txt" 2>&1
echo "ncu rc=$?"
grep -E "^  [a-z0-9_]+\(|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Eligible Warps|Issued Warp|Active Warps Per|Warp Cycles Per Issued|Block Limit (Registers|Shared)|stall|Stall" "$out/ncu-kernels.txt" | cut -c1-150 | head -150
