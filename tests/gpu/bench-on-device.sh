#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after ../shared/tools/device-pack built
# .device/ here: the bench tables docs/lab.md records. Full outputs go to $OUT (or
# ./device-logs), the rows worth reading to stdout (a device call returns only its tail).
# Usage: bash tests/gpu/bench-on-device.sh [decode] [probe] [prefill] [boundary] [32b]
#   (default: decode probe prefill; ROWS=a,b adds the decode table's rows of the switches whose
#   names contain a or b, each off, besides the defaults; "32b": issue 31's rows, the 32B
#   shape's decode a step a call against step_n at 48 and 8k, then its context sweep to 32,000,
#   ~300 s)
set -uo pipefail
# A pack carried as a tarball (tests/gpu/pack-carry.sh) unpacks here first.
[[ -d .device || ! -f .dz/device.tgz ]] || tar xzf .dz/device.tgz
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
      32b) timeout 200 $bench --step-loop qwen25_32b 48,8192 > "$out/step-loop-32b.txt" 2>&1 || status=1
           grep -vE "^\s*$" "$out/step-loop-32b.txt"
           # 32,000, not 32,768: the bench's room check at max_seq 32,768 refuses the latter.
           timeout 220 $bench --context qwen25_32b 48,2048,32000 > "$out/context-32b.txt" 2>&1 || status=1
           grep -E "^ +[0-9]+ +[0-9.]+ |power cap|^   depth" "$out/context-32b.txt" ;;
      *) echo "unknown table: $w (decode, probe, prefill, boundary, 32b)"; status=1 ;;
    esac
  done
done
exit $status
