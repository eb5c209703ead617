#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after ../shared/tools/device-pack built
# .device/ here: every packed test with DV2_REQUIRE_CUDA=1, the C and Python examples with
# --backend cuda, and compute-sanitizer memcheck/racecheck on the C example (and on the
# long-context attention's and GEMV v3's tests).
# Logs go to $OUT (or ./device-logs).
# Usage: bash tests/gpu/run-on-device.sh [suite] [gates] [switches] [examples] [sanitize] [soak]
#   [big] [prehopper] [prehopper-sanitize] [prehopper-speed] [maxseq-speed] [tail-merge]
#   [tail-merge-speed]
#   (no part named: suite, gates, switches and examples; "sanitize" alone: those and the
#   sanitizers; "suite" is every packed test but cuda_gates, "gates" cuda_gates alone: 500-580 s
#   on an H100 (sessions 61-62), so the two need separate device calls of 600 s, as the switch
#   sweep does; "soak": the
#   GPU soak (tests/cuda_soak.rs), "big": the Qwen2.5-32B shape against the oracle, minutes
#   and ~40 GB of host memory, "prehopper": the pre-Hopper path forced (DV2_HOPPER=0) through
#   every GPU gate (~10 minutes), "prehopper-sanitize": the C example under the sanitizers with
#   it, and "prehopper-speed": the 3B context sweep with it beside the default;
#   "maxseq-speed": the 3B sweep at max_seq 65,536 beside the K halves off and v2; "tail-merge"
#   and "tail-merge-speed": the DV2_X_TAIL_MERGE=1 experiment's gates and sanitizers, and its
#   sweeps; each only when named)
set -uo pipefail
# A pack carried as a tarball (tests/gpu/pack-carry.sh) unpacks here first.
[[ -d .device || ! -f .dz/device.tgz ]] || tar xzf .dz/device.tgz
parts=" $* "
[[ $parts == "  " || $parts == " sanitize " ]] && parts=" suite gates switches examples $* "
want() { [[ $parts == *" $1 "* ]]; }
out=${OUT:-device-logs}; mkdir -p "$out"
export DV2_REQUIRE_CUDA=1 DV2_CACHE_DIR=/tmp/dv2-cache
export LD_LIBRARY_PATH="$PWD/.device/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"

# The test binaries hold the paths they were built at; that path leads here (as in
# .device/run-tests.sh).
pack_root=$(sed -n 's/^pack_root="\(.*\)"$/\1/p' .device/run-tests.sh)
[[ -z $pack_root || -e $pack_root ]] || { mkdir -p "$(dirname "$pack_root")" && ln -s "$PWD" "$pack_root"; }
# Packed test binaries by name, each with --nocapture, into one log; the lines worth reading.
run_tests() {
  local log=$1; shift
  : > "$log"
  for t in "$@"; do
    echo "== $t" >> "$log"
    "$t" --nocapture >> "$log" 2>&1 || { echo "FAILED: ${t##*/}" >> "$log"; status=1; }
  done
  grep -E "^== |^test |test result|SKIP|FAILED|panicked|max \|logit|oracle|built in|qwen25|chunk" "$log" | grep -v "^test .* ok$" | tail -50
}
if want suite; then
  run_tests "$out/tests.log" $(ls .device/tests/* | grep -v '/cuda_gates$')
fi
if want gates; then
  run_tests "$out/gates.log" .device/tests/cuda_gates
fi

# A cuda_gates test under switch settings ("NAME=value" words); one line: ok or FAILED and
# the max logit errors it prints, one a case. Logs in $switch_logs, tarred at the sweep's end.
switch_logs="$out/switch-logs"
gates_with() {
  local test=$1; shift
  local log="$switch_logs/$test-$(echo "$*" | tr ' =' '_-' | tr 'A-Z' 'a-z').log"
  local result
  env "$@" .device/tests/cuda_gates --nocapture "$test" > "$log" 2>&1 && result=ok || { result=FAILED; status=1; }
  # The tests print "max |logit - oracle| = E", "max |logit - oracle| E" or "max |logit diff| E";
  # one that compares ids only prints none.
  local errors
  errors=$(grep -oE 'max \|logit (- oracle|diff)\|( =)? [0-9.]+' "$log" | awk '{print $NF}' | paste -sd/ -)
  echo "$* ($test): $result${errors:+, max |logit error| $errors}"
}
if want switches; then
  # Each switch of the configuration table (src/config.rs) off, on the tiny presets' gates, over
  # 35 chunks, from a chunked prefill, and on the 3B shape; the decode step's linears through
  # the tensor-core GEMM; the prompt fed token by token through the decode step. Not here:
  # DV2_LOGITS_W20 (taken only at K = 5,120: cuda_gemv runs both walks against the CPU),
  # DV2_DOWN_W27 (taken only at K = 27,648: cuda_gemv runs both walks against the CPU),
  # DV2_LOADS_FIRST (only the 32B shape's one-CTA-an-SM walks change, which none of these
  # presets runs; `bench --against DV2_LOADS_FIRST=0` found its logits equal to the bit,
  # docs/lab.md session 50) and DV2_MAPPED_CODES (bitsandbytes directories only; the same
  # bytes, copied or not).
  mkdir -p "$switch_logs"
  for v in DV2_GRAPH=0 DV2_PDL=0 DV2_FUSE_RMS=0 DV2_FFN_F16=0 DV2_QKV_KHALVES=0 DV2_LOGITS_ARGMAX=0 \
    DV2_ATTN_LONG=0 DV2_HOPPER=0 DV2_PREFILL_TAIL=0 DV2_LINEAR=mma DV2_PREFILL=n1 \
    DV2_STAGED_UPLOAD=0; do
    gates_with gates_match $v
  done
  gates_with long_context DV2_ATTN_LONG=0
  gates_with with_the_long_attention DV2_ATTN_LONG=0
  gates_with chunked DV2_PREFILL_TAIL=0
  gates_with a_short_chunk_deep DV2_PREFILL_SPLIT=0
  gates_with a_rewound DV2_PREFILL_SPLIT=0
  gates_with speculative DV2_QKV_ROPE=0
  gates_with a_saved_state DV2_STAGED_UPLOAD=0
  for v in DV2_QKV_KHALVES=0 DV2_LOGITS_ARGMAX=0 DV2_FFN_F16=0 DV2_FUSE_RMS=0; do
    gates_with qwen25_3b_shape $v
  done
  # The sampler's select passes alone draw the reference's ids too.
  DV2_SAMPLE_SHORTCUTS=0 .device/tests/sampling --nocapture cuda_every_path > "$switch_logs/sampling-no-shortcuts.log" 2>&1 \
    && echo "DV2_SAMPLE_SHORTCUTS=0 (cuda_every_path_draws_the_references_ids): ok" \
    || { echo "DV2_SAMPLE_SHORTCUTS=0 (cuda_every_path_draws_the_references_ids): FAILED"; status=1; }
  # One file for the sweep's ~25 logs: a call returns only a few files from $OUT (session 85).
  tar czf "$out/switch-logs.tgz" -C "$out" switch-logs && rm -r "$switch_logs"
fi

build_c_example() {
  [[ -x /tmp/gates ]] || cc -std=c99 -O2 -g -Wall -Iinclude examples_c/gates.c -L.device/lib -ldecodev2 -o /tmp/gates
}
# memcheck and racecheck on the C example, under the "NAME=value" words after the first
# argument (none: the default path); logs named PREFIXsanitizer-TOOL.log (PREFIX: the first).
sanitize_c_example() {
  local prefix=$1; shift
  local label=${*:+$* }
  build_c_example || status=1
  for tool in memcheck racecheck; do
    env "$@" compute-sanitizer --tool $tool --error-exitcode 7 /tmp/gates --backend cuda --quiet \
      > "$out/${prefix}sanitizer-$tool.log" 2>&1 \
      && echo "${label}compute-sanitizer $tool: ok" || { echo "${label}compute-sanitizer $tool: FAILED"; status=1; }
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|failed gates" "$out/${prefix}sanitizer-$tool.log" | tail -3
  done
}
# One packed test (TEST empty: all of BINARY's, one at a time) under a compute-sanitizer tool: a
# line saying ok or FAILED, then the log's summary lines.
# Usage: sanitize_test LABEL LOG_NAME TOOL BINARY TEST [SANITIZER_OPTION...]
sanitize_test() {
  local label=$1 log="$out/sanitizer-$3-$2.log" tool=$3 binary=$4 test=$5
  shift 5
  local select=(--exact "$test")
  [[ -n $test ]] || select=(--test-threads=1)
  compute-sanitizer --tool $tool "$@" --error-exitcode 7 "$binary" "${select[@]}" > "$log" 2>&1 \
    && echo "compute-sanitizer $tool ($label): ok" || { echo "compute-sanitizer $tool ($label): FAILED"; status=1; }
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result" "$log" | tail -3
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
  sanitize_c_example ""
  # The long-context attention past 2k slots (its cluster merge by pushes on an mbarrier,
  # several clusters merging through global memory): memcheck and racecheck on every kernel
  # (racecheck ~115 s on an H100); synccheck on its kernels alone. racecheck with a kernel
  # filter (any: attn_long, rms_norm, the column kernels) stops at "Internal Sanitizer Error:
  # failed to handle a hardware exception" on this test and on the C example, where both are
  # clean with every kernel instrumented (docs/lab.md, session 80).
  for tool in memcheck racecheck synccheck; do
    only=(); [[ $tool == synccheck ]] && only=(--kernel-name kns=attn_long)
    sanitize_test "long-context attention" long $tool .device/tests/cuda_gates \
      graph_replay_equals_eager_with_the_long_attention "${only[@]}"
  done
  # GEMV v3's kernels: memcheck over every cuda_gemv test (~27 s on an H100: the decode walks
  # and the column kernels, whose read past a matrix of 200 rows it found in session 80);
  # racecheck on the column kernels' test (a short chunk's linears: staged, from L2, K split in
  # clusters), where it found two races the C example met only by its prompts' lengths
  # (docs/lab.md, session 76). Every kernel instrumented: the test's GEMM path launches
  # kernels a kns=gemv3_cols filter would leave out, and a filter is what the sanitizer fails
  # on above.
  sanitize_test cuda_gemv gemv memcheck .device/tests/cuda_gemv ""
  sanitize_test "column kernels" cols racecheck .device/tests/cuda_gemv \
    a_short_prefill_chunks_linears_match_the_cpu_on_both_paths
fi
if want soak; then
  .device/tests/cuda_soak --nocapture --ignored --test-threads=1 > "$out/soak.log" 2>&1 \
    && echo "GPU soak: ok" || { echo "GPU soak: FAILED"; status=1; }
  grep -E "soak:|cycles|engines in|test result|panicked" "$out/soak.log" | tail -8
fi
if want prehopper; then
  # What a GPU without clusters or PDL runs (sm_80-89), forced on this one (issue 37).
  DV2_HOPPER=0 .device/tests/cuda_gates --test-threads=16 > "$out/prehopper-gates.log" 2>&1 \
    && echo "DV2_HOPPER=0 cuda_gates: ok" || { echo "DV2_HOPPER=0 cuda_gates: FAILED"; status=1; }
  grep -E "test result|FAILED|panicked" "$out/prehopper-gates.log" | tail -4
fi
# Separate from the gates, which took 588 s of a call's 600 at 16 threads (session 33).
if want prehopper-sanitize; then
  sanitize_c_example prehopper- DV2_HOPPER=0
fi
if want prehopper-speed; then
  .device/examples/bench --json "$out/prehopper-context.json" --context qwen25_3b --against DV2_HOPPER=0 \
    > "$out/prehopper-context.log" 2>&1 || { echo "bench --against DV2_HOPPER=0: FAILED"; status=1; }
  grep -vE "^\s*$" "$out/prehopper-context.log" | tail -14
fi
if want maxseq-speed; then
  # Past 32,768 slots of max_seq (session 87: attention v2 no longer falls back to v1 there,
  # and q/k/v's K halves run wherever the attention adds them): the 3B sweep at max_seq 65,536
  # beside the halves off, then beside attention v2.
  for against in DV2_QKV_KHALVES=0 DV2_ATTN_LONG=0; do
    log="$out/maxseq-65536-${against%%=*}.log"
    .device/examples/bench --context qwen25_3b 48,2048,8192,32512 --max-seq 65536 --against $against \
      > "$log" 2>&1 || { echo "bench --max-seq 65536 --against $against: FAILED"; status=1; }
    grep -vE "^\s*$" "$log" | tail -14
  done
fi
if want tail-merge; then
  # The experiment DV2_X_TAIL_MERGE=1 (docs/lab.md, session 87: the splits of attention v2 and
  # of the flat long attention merged by their own last CTAs instead of attn2_merge): v2 on
  # the tiny presets (head_dim 16, which the long attention does not take) and at depth under
  # DV2_ATTN_LONG=0; the flat long attention under DV2_HOPPER=0; memcheck and racecheck on the
  # flat one's graph test and on the C example (v2).
  mkdir -p "$switch_logs"
  gates_with gates_match DV2_X_TAIL_MERGE=1
  for t in long_context with_the_long_attention; do
    gates_with $t DV2_ATTN_LONG=0 DV2_X_TAIL_MERGE=1
  done
  for t in long_context a_long_max_seq long_attention; do
    gates_with $t DV2_HOPPER=0 DV2_X_TAIL_MERGE=1
  done
  tar czf "$out/tail-merge-logs.tgz" -C "$out" switch-logs && rm -r "$switch_logs"
  for tool in memcheck racecheck; do
    DV2_HOPPER=0 DV2_X_TAIL_MERGE=1 sanitize_test "flat long attention, tail merge" tail-merge $tool \
      .device/tests/cuda_gates graph_replay_equals_eager_with_the_long_attention
  done
  sanitize_c_example tail-merge- DV2_X_TAIL_MERGE=1
fi
if want tail-merge-speed; then
  # Decode across depth with the experiment beside attn2_merge in one process: the flat long
  # attention (DV2_HOPPER=0), then attention v2 (DV2_ATTN_LONG=0).
  for path in DV2_HOPPER=0 DV2_ATTN_LONG=0; do
    log="$out/tail-merge-${path%%=*}.log"
    env $path DV2_X_TAIL_MERGE=1 .device/examples/bench --context qwen25_3b 48,2048,8192,32512 \
      --against DV2_X_TAIL_MERGE=0 > "$log" 2>&1 || { echo "$path bench --against DV2_X_TAIL_MERGE=0: FAILED"; status=1; }
    grep -vE "^\s*$" "$log" | tail -14
  done
fi
if want big; then
  .device/tests/cuda_gates --nocapture --ignored --exact qwen25_32b_shape_decodes_like_the_oracle \
    > "$out/qwen25-32b.log" 2>&1 && echo "qwen25_32b shape vs oracle: ok" || { echo "qwen25_32b shape vs oracle: FAILED"; status=1; }
  grep -E "qwen25_32b|oracle:|test result|panicked" "$out/qwen25-32b.log" | tail -6
fi
exit $status
