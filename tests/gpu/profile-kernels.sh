#!/usr/bin/env bash
# Runs on the GPU machine after ../shared/tools/device-pack: ncu's speed-of-light, occupancy,
# scheduler, warp-state and source-counter sections for one layer's decode kernels (q/k/v,
# attention (v3, or v2 and its merge), o, gate/up, down) in an eager decode step of the
# Qwen2.5-3B shape after a 48-token prompt. Prints the lines worth reading; the whole report
# goes to $OUT.
# With `shapes PRESET` instead: the same sections for GEMV v2's SwiGLU (gate and up) on that
# preset's shapes, one launch of `bench --shapes PRESET --skip-3b`'s microbenchmark (random
# weights, rotated copies: from HBM), e.g. qwen25_32b, whose large GEMVs stream at ~60% of a
# plain read (docs/lab.md, session 23): which stalls hold them there.
# PRESET: another shape for the decode step (qwen25_32b: its K walks, gemv2_kwalk_*, whose
# issue counts session 38 had not read), 5 kernels a layer as on the 3B shape.
# NCU_KERNELS: another kernel-name regex for the decode step (e.g. an experiment's kernel
# beside the two it replaces: NCU_KERNELS='gemv2_ffn_fused|gemv2_swiglu|gemv2_nf4_j3'), with
# NCU_SKIP: how many matching launches to skip first (default 200).
# With `skeleton` instead: those sections and the memory tables (shared memory's wavefronts and
# bank conflicts) for the persistent step's skeleton (`bench --boundary`'s grid_layers,
# kernels/bench.cu) walking the 3B shape's layers with no hand-over, one launch: what holds its
# table walk at 2.3 TB/s where its shared-memory wavefronts allow 5.6 and its issue 6.4
# (issue 36; docs/lab.md, sessions 48, 60 and 64).
# Usage: bash tests/gpu/profile-kernels.sh [shapes PRESET | skeleton]
set -uo pipefail
out=${OUT:-device-logs}; mkdir -p "$out"
export DV2_CACHE_DIR=/tmp/dv2-cache
export LD_LIBRARY_PATH="$PWD/.device/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
sections=(--section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats
  --section SourceCounters --section LaunchStats)
if [[ ${1:-} == skeleton ]]; then
  # grid_layers_us times 3 + 25 graph replays of one launch a row; the rows run barriers,
  # flagged pairs, then no hand-over: launches 57-84 are the third row's.
  # --print-details all and the stall metrics: the warp-state section's stall reasons are a
  # chart, which the command line leaves out otherwise (session 65).
  timeout 500 "$ncu" "${sections[@]}" --section MemoryWorkloadAnalysis_Tables --print-details all \
    --metrics 'regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$' --kernel-name grid_layers \
    --launch-skip 60 --launch-count 1 .device/examples/bench --boundary > "$out/ncu-kernels.txt" 2>&1
elif [[ ${1:-} == shapes ]]; then
  # The third launch: past the warm-up ones, on a rotated copy of the weights.
  timeout 500 "$ncu" "${sections[@]}" --kernel-name regex:'gemv2_swiglu' --launch-skip 2 --launch-count 1 \
    .device/examples/bench --shapes "${2:?usage: profile-kernels.sh shapes PRESET}" --skip-3b \
    --json /tmp/ncu-shapes.json > "$out/ncu-kernels.txt" 2>&1
else
  # --launch-skip counts the launches that match the filter only: 5 a layer by default (180 a
  # step at 36 layers), so 200 lands in the second decode step (the prefill's kernels do not
  # match). It was 1000 with attn_long missing from the filter: 864 matches in 6 steps, none
  # profiled (session 34). NCU_SKIP: another skip for an NCU_KERNELS with fewer matches.
  timeout 400 "$ncu" "${sections[@]}" --kernel-name regex:"${NCU_KERNELS:-gemv3_|gemv2_swiglu|gemv2_nf4_j3|gemv2_kwalk|attn_long|attn2_}" \
    --launch-skip "${NCU_SKIP:-200}" --launch-count 6 .device/examples/bench --decode-profile 6 48 "${PRESET:-qwen25_3b}" \
    > "$out/ncu-kernels.txt" 2>&1
fi
echo "ncu rc=$?"
grep -E "^  [a-z0-9_]+\(|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Eligible Warps|Issued Warp|Active Warps Per|Warp Cycles Per Issued|Block Limit (Registers|Shared)|stall|Stall|Bank Conflicts|Wavefronts|MIO|issue_stalled" "$out/ncu-kernels.txt" | cut -c1-150 | head -150
