#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after ../shared/tools/device-pack built
# .device/ here: the bench tables docs/lab.md records. Full outputs go to $OUT (or
# ./device-logs), the rows worth reading to stdout (a device call returns only its tail).
# Usage: bash tests/gpu/bench-on-device.sh [decode] [probe] [prefill] [boundary]
#   (default: decode probe prefill; ROWS=a,b adds the decode table's rows of the switches whose
#   names contain a or b, each off, besides the defaults)
set -uo pipefail
out=${OUT:-device-logs}; mkdir -p "$out"
export DV2_CACHE_DIR=/tmp/dv2-cache
export LD_LIBRARY_PATH="$PWD/.device/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
bench=.device/examples/bench
status=0
for what in "${@:-decode probe prefill}"; do
  for w in $what; do
    case $w in
      decode) timeout 300 $bench --skip-kernels --skip-variants --split ${ROWS:+--rows "$ROWS"} > "$out/decode.txt" 2>&1 || status=1
              grep -E "^  (qwen25|medium)|built in|^  .* ms +[0-9.]+%" "$out/decode.txt" ;;
      probe) timeout 300 $bench --probe > "$out/probe.txt" 2>&1 || status=1
             grep -E "^gemv|^gemm [^ ]+ N=48" "$out/probe.txt" ;;
      prefill) timeout 300 $bench --prefill-only --skip-kernels --skip-gemm > "$out/prefill.txt" 2>&1 || status=1
               grep -E "^  (default|n1|DV2_)" "$out/prefill.txt" ;;
      boundary) timeout 120 $bench --boundary > "$out/boundary.txt" 2>&1 || status=1
                cat "$out/boundary.txt" ;;
      *) echo "unknown table: $w (decode, probe, prefill, boundary)"; status=1 ;;
    esac
  done
done
exit $status
