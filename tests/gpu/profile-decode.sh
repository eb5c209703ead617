#!/usr/bin/env bash
# Runs on the GPU machine after ../shared/tools/device-pack: each decode kernel's own duration
# (ncu gpu__time_duration, kernels serialized, so no launch overlap) over two eager decode
# steps of the Qwen2.5-3B shape after a 48-token prompt, summed per kernel name. Set against
# the graph's ms/token, the difference is what kernel boundaries cost in the graph.
# Usage: bash tests/gpu/profile-decode.sh [bench binary]   (full CSV to $OUT or ./device-logs;
# default .device/examples/bench; switches from the environment; STEPS=n eager steps, default 8:
# more where kernels are fused, fewer launches a step; NCU_ARGS: more ncu options, e.g.
# "--clock-control none" for the boost clocks instead of ncu's default base clocks)
set -uo pipefail
out=${OUT:-device-logs}; mkdir -p "$out"
export DV2_CACHE_DIR=/tmp/dv2-cache
export LD_LIBRARY_PATH="$PWD/.device/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
# Decode-step kernels only; the first 4 steps' worth (warm-up, prefill's last token, 2 steps)
# skipped at 6 kernels a layer, then 440 launches: 2 steps at 6 kernels a layer, more steps
# where kernels are fused; the steps counted by their argmax launches.
timeout 400 "$ncu" --csv --metrics gpu__time_duration.sum ${NCU_ARGS:-} \
  --kernel-name regex:'gemv|attn2_|argmax_logits|commit_step|rms_norm' \
  --launch-skip 880 --launch-count 440 "${1:-.device/examples/bench}" --decode-profile "${STEPS:-8}" > "$out/ncu-decode.csv" 2> "$out/ncu-decode.err"
echo "ncu rc=$?"
python3 - "$out/ncu-decode.csv" <<'PY'
import csv, sys, collections, statistics
lines = list(csv.reader(open(sys.argv[1])))
start = next(i for i, r in enumerate(lines) if r[:1] == ["ID"])  # ncu's header; before it, bench's output
head, rows = lines[start], [r for r in lines[start + 1 :] if len(r) == len(lines[start])]
name_i, val_i, unit_i = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
# whole steps only: from the first argmax launch's successor to the last argmax launch
names = [r[name_i].split("(")[0] for r in rows]
ends = [i for i, n in enumerate(names) if n.startswith("argmax_logits")]
steps = len(ends) - 1
by = collections.defaultdict(list)
for r, n in list(zip(rows, names))[ends[0] + 1 : ends[-1] + 1]:
    v = float(r[val_i].replace(",", ""))
    us = v / 1e3 if r[unit_i] in ("nsecond", "ns") else (v if r[unit_i] in ("usecond", "us") else v * 1e3)
    by[n].append(us)
total = sum(sum(v) for v in by.values())
print(f"{len(rows)} launches, {steps} whole steps, {total / steps:.1f} us per step")
for k, v in sorted(by.items(), key=lambda kv: -sum(kv[1])):
    print(f"  {k:<28} n={len(v):4d}  median {statistics.median(v):7.2f} us  per step {sum(v) / steps:8.1f} us")
PY
