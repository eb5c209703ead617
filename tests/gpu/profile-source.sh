#!/usr/bin/env bash
# Runs on the GPU machine after ../shared/tools/device-pack: ncu's warp-state sampling per SASS
# instruction for one launch of each named decode kernel (an eager decode step of the
# Qwen2.5-3B shape after a DEPTH-token prompt), to time the links of a kernel's dependency
# chain: which instructions the warps wait at, and on what. Prints each kernel's 25 most
# sampled instructions; the source pages (CSV, gzipped) go to $OUT (or ./device-logs).
# Usage: bash tests/gpu/profile-source.sh [kernel regex]   (default 'gemv3_store|attn2_decode';
# DEPTH: the prompt's length, 48; switches from the environment; NCU_ARGS: more ncu options;
# SKIP: matching launches skipped, default 200, enough past the prompt for two kernels of 36
# layers in 4 steps)
set -uo pipefail
out=${OUT:-device-logs}; mkdir -p "$out"
export DV2_CACHE_DIR=/tmp/dv2-cache
export LD_LIBRARY_PATH="$PWD/.device/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
regex=${1:-gemv3_store|attn2_decode}
report=/tmp/dv2-source
# Past the warm-up and the prompt: the 201st and 202nd matching launches (with the default
# regex, one of each: the step launches them in turn, once per layer).
timeout 400 "$ncu" --section WarpStateStats --section SourceCounters --import-source no ${NCU_ARGS:-} \
  --kernel-name regex:"$regex" --launch-skip ${SKIP:-200} --launch-count 2 -f -o "$report" \
  .device/examples/bench --decode-profile 4 ${DEPTH:-48} > "$out/ncu-source.log" 2>&1
echo "ncu rc=$?"
"$ncu" -i "$report.ncu-rep" --page source --print-source sass --csv > /tmp/dv2-source.csv 2>> "$out/ncu-source.log"
echo "export rc=$?"
gzip -c /tmp/dv2-source.csv > "$out/ncu-source.csv.gz"
python3 - /tmp/dv2-source.csv <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
# One table per kernel, each opened by a header row that names the Source column.
tables, cur = [], None
for r in rows:
    if "Source" in r:
        cur = {"head": r, "rows": []}
        tables.append(cur)
    elif cur is not None and len(r) == len(cur["head"]):
        cur["rows"].append(r)
def num(v):
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return 0.0
for t in tables:
    h = t["head"]
    sampled = [i for i, c in enumerate(h) if "Sampling" in c and "All" in c] or [i for i, c in enumerate(h) if "Sampling" in c]
    if not sampled:
        print("no sampling column in:", h[:12])
        continue
    key, src = sampled[0], h.index("Source")
    total = sum(num(r[key]) for r in t["rows"]) or 1.0
    print(f"\n{len(t['rows'])} SASS lines, {total:.0f} samples ({h[key]})")
    for r in sorted(t["rows"], key=lambda r: -num(r[key]))[:25]:
        print(f"  {100 * num(r[key]) / total:5.1f}%  {r[src][:90]}")
PY
