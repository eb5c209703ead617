#!/usr/bin/env bash
# Runs on the GPU machine: the decode table's default rows of several bench binaries
# (tests/gpu/pack-bench-variants.sh), in turn and then again in reverse order, so that a drift
# of the machine shows as a difference between the two passes. One process per binary: compare
# them with that in mind (machines differ by 1-2% between calls; within one call, repeated rows
# agree to ~0.002 ms). Full outputs under $OUT/compare (or ./device-logs/compare).
# Usage: bash tests/gpu/compare-benches.sh NAME [NAME...]   (NAME: .device/examples/bench-NAME;
#   "packed": .device/examples/bench, the packed checkout's own)
set -uo pipefail
out=${OUT:-device-logs}/compare; mkdir -p "$out"
export DV2_CACHE_DIR=/tmp/dv2-cache
export LD_LIBRARY_PATH="$PWD/.device/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
names=("$@")
reversed=(); for ((i = ${#names[@]} - 1; i >= 0; i--)); do reversed+=("${names[i]}"); done
pass=0
for order in "${names[*]}" "${reversed[*]}"; do
  pass=$((pass + 1))
  for name in $order; do
    bin=.device/examples/bench-$name; [[ $name == packed ]] && bin=.device/examples/bench
    timeout 300 "$bin" --skip-kernels --skip-variants --rows none > "$out/$name-$pass.txt" 2>&1
    echo "pass $pass $name: $(grep -E '^  qwen25_3b ' "$out/$name-$pass.txt" | awk '{print $(NF-1)}' | paste -sd' ' -) ms/token (default, again)"
  done
done
