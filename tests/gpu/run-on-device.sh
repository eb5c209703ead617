#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after ../shared/tools/device-pack built
# .device/ here: every packed test with DV2_REQUIRE_CUDA=1, the C and Python examples with
# --backend cuda, and compute-sanitizer memcheck/racecheck on the C example.
# Logs go to $OUT (or ./device-logs). Usage: bash tests/gpu/run-on-device.sh [sanitize]
set -uo pipefail
out=${OUT:-device-logs}; mkdir -p "$out"
export DV2_REQUIRE_CUDA=1 DV2_CACHE_DIR=/tmp/dv2-cache
export LD_LIBRARY_PATH="$PWD/.device/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"

bash .device/run-tests.sh --nocapture > "$out/tests.log" 2>&1 || status=1
grep -E "^test |test result|SKIP|FAILED|panicked|max \|logit|oracle|built in|qwen25|chunk" "$out/tests.log" | grep -v "^test .* ok$" | tail -50

# The v1 kernels stay selectable (DV2_GEMV=v1, DV2_ATTN=v1): they must pass the gates too.
DV2_GEMV=v1 DV2_ATTN=v1 .device/tests/cuda_gates --nocapture gates_match > "$out/tests-v1.log" 2>&1 \
  && echo "v1 kernels, gates: ok" || { echo "v1 kernels, gates: FAILED"; status=1; }
grep -E "max \|logit" "$out/tests-v1.log"
# The default GEMV picks v3 or v2 per matrix; each forced everywhere must pass too.
for v in v2 v3; do
  DV2_GEMV=$v .device/tests/cuda_gates --nocapture gates_match > "$out/tests-gemv-$v.log" 2>&1 \
    && echo "DV2_GEMV=$v, gates: ok" || { echo "DV2_GEMV=$v, gates: FAILED"; status=1; }
  grep -E "max \|logit" "$out/tests-gemv-$v.log"
done
DV2_PDL=0 .device/tests/cuda_gates --nocapture gates_match > "$out/tests-pdl0.log" 2>&1 \
  && echo "DV2_PDL=0, gates: ok" || { echo "DV2_PDL=0, gates: FAILED"; status=1; }
DV2_ATTN_BATCH=0 .device/tests/cuda_gates --nocapture gates_match > "$out/tests-attn-serial.log" 2>&1 \
  && echo "DV2_ATTN_BATCH=0, gates: ok" || { echo "DV2_ATTN_BATCH=0, gates: FAILED"; status=1; }
DV2_GEMV2_PAIRS=0 .device/tests/cuda_gates --nocapture gates_match > "$out/tests-gemv2-nibbles.log" 2>&1 \
  && echo "DV2_GEMV2_PAIRS=0, gates: ok" || { echo "DV2_GEMV2_PAIRS=0, gates: FAILED"; status=1; }
DV2_GEMV_WFIRST=0 .device/tests/cuda_gates --nocapture gates_match > "$out/tests-gemv-xfirst.log" 2>&1 \
  && echo "DV2_GEMV_WFIRST=0, gates: ok" || { echo "DV2_GEMV_WFIRST=0, gates: FAILED"; status=1; }
DV2_GEMV2_XSMEM=0 .device/tests/cuda_gates --nocapture gates_match > "$out/tests-gemv2-x-global.log" 2>&1 \
  && echo "DV2_GEMV2_XSMEM=0, gates: ok" || { echo "DV2_GEMV2_XSMEM=0, gates: FAILED"; status=1; }
DV2_ATTN_MERGE=kernel .device/tests/cuda_gates --nocapture gates_match > "$out/tests-attn-merge-kernel.log" 2>&1 \
  && echo "DV2_ATTN_MERGE=kernel, gates: ok" || { echo "DV2_ATTN_MERGE=kernel, gates: FAILED"; status=1; }
DV2_GEMV3_EPI_EARLY=0 .device/tests/cuda_gates --nocapture gates_match > "$out/tests-gemv3-epi-late.log" 2>&1 \
  && echo "DV2_GEMV3_EPI_EARLY=0, gates: ok" || { echo "DV2_GEMV3_EPI_EARLY=0, gates: FAILED"; status=1; }
DV2_GEMV2_LATE=0 .device/tests/cuda_gates --nocapture gates_match > "$out/tests-gemv2-per-iteration.log" 2>&1 \
  && echo "DV2_GEMV2_LATE=0, gates: ok" || { echo "DV2_GEMV2_LATE=0, gates: FAILED"; status=1; }
DV2_L2_AHEAD_KB=0 .device/tests/cuda_gates --nocapture gates_match > "$out/tests-no-l2-prefetch.log" 2>&1 \
  && echo "DV2_L2_AHEAD_KB=0, gates: ok" || { echo "DV2_L2_AHEAD_KB=0, gates: FAILED"; status=1; }
DV2_FUSE_RMS=0 .device/tests/cuda_gates --nocapture gates_match > "$out/tests-rms-kernel.log" 2>&1 \
  && echo "DV2_FUSE_RMS=0 (RMSNorm kernels), gates: ok" || { echo "DV2_FUSE_RMS=0 (RMSNorm kernels), gates: FAILED"; status=1; }
grep -E "max \|logit" "$out/tests-rms-kernel.log"
# The decode step's linears through the tensor-core GEMM (DV2_LINEAR=mma), and the prompt
# fed token by token through the decode step (DV2_PREFILL=n1).
DV2_LINEAR=mma .device/tests/cuda_gates --nocapture gates_match > "$out/tests-linear-mma.log" 2>&1 \
  && echo "DV2_LINEAR=mma, gates: ok" || { echo "DV2_LINEAR=mma, gates: FAILED"; status=1; }
grep -E "max \|logit" "$out/tests-linear-mma.log"
# The prefill kernel variants: CUDA-core attention, the first KV staging, each GEMM kernel
# forced, and each GEMM switch off.
for v in DV2_ATTNP=simt DV2_ATTNP_STAGE=v1 DV2_GEMM=v1 DV2_GEMM=v2 DV2_GEMM_X16=0 DV2_GEMM_CLUSTER=0 DV2_GEMM_EARLY=0 DV2_PREFILL_TAIL=0 DV2_GEMM_SPREAD=0; do
  env $v .device/tests/cuda_gates --nocapture chunked > "$out/tests-prefill-${v#DV2_}.log" 2>&1 \
    && echo "$v, chunked prefill: ok" || { echo "$v, chunked prefill: FAILED"; status=1; }
  grep -E "chunk 32|token chunk" "$out/tests-prefill-${v#DV2_}.log"
done
DV2_PREFILL=n1 .device/tests/cuda_gates --nocapture gates_match > "$out/tests-prefill-n1.log" 2>&1 \
  && echo "DV2_PREFILL=n1, gates: ok" || { echo "DV2_PREFILL=n1, gates: FAILED"; status=1; }
grep -E "max \|logit" "$out/tests-prefill-n1.log"

cc -std=c99 -O2 -g -Wall -Iinclude examples_c/gates.c -L.device/lib -ldecodev2 -o /tmp/gates \
  && /tmp/gates --backend cuda > "$out/c-example.log" 2>&1 && echo "C example (cuda): ok" \
  || { echo "C example (cuda): FAILED"; status=1; }
tail -3 "$out/c-example.log"
DV2_LIB=.device/lib/libdecodev2.so python3 examples_c/gates.py --backend cuda > "$out/py-example.log" 2>&1 \
  && echo "Python example (cuda): ok" || { echo "Python example (cuda): FAILED"; status=1; }
tail -1 "$out/py-example.log"

if [[ ${1:-} == sanitize ]]; then
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --error-exitcode 7 /tmp/gates --backend cuda --quiet > "$out/sanitizer-$tool.log" 2>&1 \
      && echo "compute-sanitizer $tool: ok" || { echo "compute-sanitizer $tool: FAILED"; status=1; }
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|failed gates" "$out/sanitizer-$tool.log" | tail -3
  done
fi
exit $status
