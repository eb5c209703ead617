#!/usr/bin/env bash
# Runs a command on the GPU machine with nvidia-smi sampling the GPU every 50 ms beside it, then
# summarizes the busy samples (over 300 W): SM clock p10/p50/p90, power p10/p50/max, and the
# throttle reasons by count (0x4: the software power cap, the 700 W limit on an H200). Why: the
# same kernels ran the 32B shape at 177-187 tok/s on different H200s (docs/lab.md, sessions
# 45-47), more apart than their streaming bandwidths; this puts each machine's clocks and power
# beside its numbers. The command's own output goes to stdout as it runs; the samples to
# $OUT/power-samples.csv (or ./device-logs).
# Usage: bash tests/gpu/power-during.sh COMMAND [ARGS...]
set -uo pipefail
out=${OUT:-device-logs}; mkdir -p "$out"
csv="$out/power-samples.csv"
: > "$csv"  # this run's samples only, even where the sampler is stopped before it writes
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 50 >> "$csv" 2>&1 &
smi=$!
"$@"
status=$?
kill "$smi" 2>/dev/null
wait "$smi" 2>/dev/null
python3 - "$csv" <<'PY'
import csv, sys
from collections import Counter
def num(s):
    try:
        return float(s.strip().split()[0])
    except (ValueError, IndexError):
        return None
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) >= 6 and num(r[3]) is not None]
busy = [r for r in rows if num(r[3]) > 300]
print(f"power: {len(rows)} samples, {len(busy)} over 300 W", end="")
if busy:
    q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]
    clk = [num(r[1]) for r in busy]
    pw = [num(r[3]) for r in busy]
    reasons = Counter(r[5].strip() for r in busy).most_common(4)
    print(f"; SM MHz p10 {q(clk, .1):.0f} p50 {q(clk, .5):.0f} p90 {q(clk, .9):.0f};"
          f" W p10 {q(pw, .1):.0f} p50 {q(pw, .5):.0f} max {max(pw):.0f}; throttle reasons {reasons}")
else:
    print()
PY
exit $status
