#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with .dx/xp/ from tests/gpu/pack-xp.sh:
# each experiment switch's cuda_gemv (the GEMV kernels against the CPU under it), then the
# context bench with the switch against the default in one process (the engines alternate;
# ids and logits compared first). Logs under $OUT (or ./device-logs).
# CONTROL=1 first runs the same bench against a setting that changes nothing in the decode
# (DV2_STAGED_UPLOAD=0: how weights are uploaded), so the call carries its own spread.
# BOTH_ORDERS=1 runs each bench twice, the second with --against-loaded-first: the engine loaded
# first ran 0.6-1.0% faster at the 32B shape's depth 48 whichever it was (session 42), so the
# paired medians of the two orders are read by their mean.
# XP=.dx/xp-NAME takes the binaries from that folder (pack-xp.sh's XP) instead of .dx/xp.
# Usage: [PRESET=qwen25_32b] [DEPTHS=48,2048,8192] [CONTROL=1] [BOTH_ORDERS=1] [XP=.dx/xp] bash tests/gpu/xp-against.sh VAR=VALUE [VAR=VALUE...]
set -uo pipefail
[[ -e /tmp/dv2-xp ]] || ln -s "$PWD" /tmp/dv2-xp
out=${OUT:-device-logs}; mkdir -p "$out"
export DV2_REQUIRE_CUDA=1 DV2_CACHE_DIR=/tmp/dv2-cache
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
preset=${PRESET:-qwen25_32b} depths=${DEPTHS:-48,2048,8192}
xp=${XP:-.dx/xp}
echo "experiments built from $(cat "$xp/REV" 2>/dev/null || echo '?')"
status=0
for setting in "$@"; do
  name=$(echo "$setting" | tr '=' '-')
  env "$setting" "$xp/cuda_gemv" --test-threads=4 > "$out/gemv-$name.txt" 2>&1 \
    && echo "$setting cuda_gemv: ok" || { echo "$setting cuda_gemv: FAILED"; status=1; }
  grep -E "test result|FAILED|panicked" "$out/gemv-$name.txt" | tail -3
done
controls=()
[[ ${CONTROL:-0} == 1 ]] && controls=(DV2_STAGED_UPLOAD=0)
for setting in ${controls[@]+"${controls[@]}"} "$@"; do
  name=$(echo "$setting" | tr '=' '-')
  echo "== bench --context $preset $depths --against $setting"
  "$xp/bench" --context "$preset" "$depths" --against "$setting" > "$out/bench-$name.txt" 2>&1 || status=1
  grep -vE "^\s*$" "$out/bench-$name.txt" | tail -20
  if [[ ${BOTH_ORDERS:-0} == 1 ]]; then
    echo "== the same, $setting loaded first"
    "$xp/bench" --context "$preset" "$depths" --against "$setting" --against-loaded-first \
      > "$out/bench-$name-loaded-first.txt" 2>&1 || status=1
    grep -E "depth [0-9]+:" "$out/bench-$name-loaded-first.txt"
  fi
done
exit $status
