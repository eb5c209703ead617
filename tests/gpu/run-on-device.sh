#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after ../shared/tools/device-pack built
# .device/ here: every packed test with DV2_REQUIRE_CUDA=1, the C and Python examples with
# --backend cuda, and compute-sanitizer memcheck/racecheck on the C example.
# Logs go to $OUT (or ./device-logs).
# Usage: bash tests/gpu/run-on-device.sh [suite] [switches] [examples] [sanitize]
#   (no part named: suite, switches and examples; "sanitize" alone: those and the sanitizers;
#   the parts can go in separate device calls, the switch sweep being the longest)
set -uo pipefail
parts=" $* "
[[ $parts == "  " || $parts == " sanitize " ]] && parts=" suite switches examples $* "
want() { [[ $parts == *" $1 "* ]]; }
out=${OUT:-device-logs}; mkdir -p "$out"
export DV2_REQUIRE_CUDA=1 DV2_CACHE_DIR=/tmp/dv2-cache
export LD_LIBRARY_PATH="$PWD/.device/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"

if want suite; then
  bash .device/run-tests.sh --nocapture > "$out/tests.log" 2>&1 || status=1
  grep -E "^test |test result|SKIP|FAILED|panicked|max \|logit|oracle|built in|qwen25|chunk" "$out/tests.log" | grep -v "^test .* ok$" | tail -50
fi

# A cuda_gates test under switch settings ("NAME=value" words); one line: ok or FAILED and
# its max |logit - oracle| per case. Logs named without '=' (such names do not come back).
gates_with() {
  local test=$1; shift
  local log="$out/$test-$(echo "$*" | tr ' =' '_-' | tr 'A-Z' 'a-z').log"
  local result
  env "$@" .device/tests/cuda_gates --nocapture "$test" > "$log" 2>&1 && result=ok || { result=FAILED; status=1; }
  echo "$* ($test): $result, max |logit - oracle| $(grep -oE 'max \|logit - oracle\| = [0-9.]+' "$log" | awk '{print $NF}' | paste -sd/ -)"
}
if want switches; then
  # The v1 kernels stay selectable; each GEMV forced everywhere (the default picks per matrix);
  # each decode switch off; the decode step's linears through the tensor-core GEMM; the prompt
  # fed token by token through the decode step.
  gates_with gates_match DV2_GEMV=v1 DV2_ATTN=v1
  # GEMV v2 everywhere with its f32-pair table (the tiny presets take v3 by default).
  gates_with gates_match DV2_GEMV=v2 DV2_GEMV2_H16=0
  # The f16 table on every linear of the tiny presets, over 35 chunks and from a chunked prefill.
  gates_with long_context DV2_GEMV=v2
  gates_with chunked DV2_GEMV=v2
  # GEMV v2's 182-236-register kernels (one CTA per SM) on every linear and on the 3B shape.
  gates_with gates_match DV2_GEMV=v2 DV2_GEMV2_NARROW=0
  gates_with qwen25_3b_shape DV2_GEMV2_NARROW=0
  # Down's L2 prefetch and lm_head's argmax where the tiny presets' down and lm_head are v2
  # (on the 3B shape they are by default).
  gates_with gates_match DV2_GEMV=v2
  gates_with qwen25_3b_shape DV2_QKV_L2=1 DV2_LOGITS_ARGMAX=0 DV2_ATTN3_ILP=0 DV2_GEMV2_NOALLOC=0
  # lm_head's kernel without the PRMT-addressed table on the 3B shape.
  gates_with qwen25_3b_shape DV2_LOGITS_PRMT=0
  # Gate/up's rows in equal shares (the skew toward the CTAs that start first is the default).
  gates_with qwen25_3b_shape DV2_GEMV2_SKEW=0
  gates_with gates_match DV2_GEMV=v2 DV2_GEMV2_SKEW=0
  # q/k/v's GEMV v3 in one part (K halves are the default since session 19).
  gates_with qwen25_3b_shape DV2_QKV_KHALVES=0
  gates_with gates_match DV2_QKV_KHALVES=0
  # The byte tables through a shared codebook (their build straight from immediates is the
  # default since session 20), and the f32-pair table built straight.
  gates_with gates_match DV2_TABLE_DIRECT=0
  gates_with gates_match DV2_GEMV=v2 DV2_GEMV2_H16=0
  # The same split for down and lm_head (measured slower in session 18, kept selectable).
  gates_with qwen25_3b_shape DV2_DOWN_SKEW=2 DV2_LOGITS_SKEW=16
  gates_with gates_match DV2_GEMV=v2 DV2_DOWN_SKEW=-2 DV2_LOGITS_SKEW=-16
  for v in DV2_GEMV=v2 DV2_GEMV=v3 DV2_PDL=0 DV2_ATTN=v2 DV2_ATTN3_SPLITS=1 DV2_ATTN3_SPLITS=2 DV2_ATTN3_SPLITS=4 DV2_ATTN3_SLOT_LANES=0 DV2_ATTN_SPLIT=1 DV2_ATTN_SPLIT=2 DV2_ATTN_SPLIT=4 DV2_GEMV2_PAIRS=0 DV2_GEMV2_H16=0 DV2_GEMV_CTAS=1 DV2_GEMV2_PREWAIT=0 DV2_TABLE_WIDE=0 DV2_TABLE_DIRECT=0 DV2_NORM_BATCH=8 DV2_GEMV2_EPI_EARLY=0 DV2_GEMV2_LATE1=0 DV2_FFN_F16=0 \
    DV2_GEMV2_XSMEM=0 DV2_GEMV2_LATE=0 DV2_GEMV_WFIRST=0 DV2_GEMV3_EPI_EARLY=0 DV2_GEMV3_PREWAIT=0 DV2_GEMV3_X_BATCH=8 DV2_GEMV2_X_BATCH=8 DV2_GEMV3_ACC_ONE=0 DV2_GEMV3_L2_CODE=1 DV2_GEMV2_X_ONE=0 DV2_GEMV3_LEAN=0 DV2_GEMV2_CHAIN=1 DV2_GEMV2_CHAIN=4 DV2_SMEM_CARVEOUT=57 DV2_SMEM_CARVEOUT=100 DV2_GEMV2_NOALLOC=0 DV2_ATTN3_ILP=0 DV2_QKV_L2=1 DV2_LOGITS_ARGMAX=0 DV2_COMMIT_FUSED=0 DV2_LOGITS_PRMT=0 DV2_GEMV2_SKEW=0 DV2_QKV_KHALVES=0 DV2_ARGMAX_CTAS=1 DV2_NVRTC_SPLIT=0 \
    DV2_L2_AHEAD_KB=192 DV2_FUSE_RMS=0 DV2_LINEAR=mma DV2_PREFILL=n1; do
    gates_with gates_match $v
  done
  # Attention v2 (the default without clusters) with each of its switches off, over 35 chunks too.
  gates_with gates_match DV2_ATTN=v2
  gates_with long_context DV2_ATTN=v2
  for v in DV2_ATTN_BATCH=0 DV2_MERGE_EARLY=0 DV2_MERGE_WARP=0 DV2_ATTN_PREWAIT=0 DV2_ATTN_HD128=0; do
    gates_with gates_match DV2_ATTN=v2 $v
  done
  # The prefill kernel variants: CUDA-core attention, the first KV staging, each GEMM kernel
  # forced, and each GEMM switch off.
  for v in DV2_ATTNP=simt DV2_ATTNP_STAGE=v1 DV2_GEMM=v1 DV2_GEMM=v2 DV2_GEMM_X16=0 DV2_GEMM_CLUSTER=0 \
    DV2_GEMM_EARLY=0 DV2_PREFILL_TAIL=0 DV2_GEMM_SPREAD=0; do
    gates_with chunked $v
  done
fi

build_c_example() {
  [[ -x /tmp/gates ]] || cc -std=c99 -O2 -g -Wall -Iinclude examples_c/gates.c -L.device/lib -ldecodev2 -o /tmp/gates
}
if want examples; then
  build_c_example && /tmp/gates --backend cuda > "$out/c-example.log" 2>&1 && echo "C example (cuda): ok" \
    || { echo "C example (cuda): FAILED"; status=1; }
  tail -3 "$out/c-example.log"
  DV2_LIB=.device/lib/libdecodev2.so python3 examples_c/gates.py --backend cuda > "$out/py-example.log" 2>&1 \
    && echo "Python example (cuda): ok" || { echo "Python example (cuda): FAILED"; status=1; }
  tail -1 "$out/py-example.log"
fi

if want sanitize; then
  build_c_example || status=1
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --error-exitcode 7 /tmp/gates --backend cuda --quiet > "$out/sanitizer-$tool.log" 2>&1 \
      && echo "compute-sanitizer $tool: ok" || { echo "compute-sanitizer $tool: FAILED"; status=1; }
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|failed gates" "$out/sanitizer-$tool.log" | tail -3
  done
fi
exit $status
