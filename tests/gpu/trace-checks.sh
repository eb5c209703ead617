#!/usr/bin/env bash
# Runs on the GPU machine after ../shared/tools/device-pack: `bench --checks` (speculative
# checks of 1, 7 and 15 draft ids, 24 in a row after a prompt of each depth) with every kernel
# timed on the GPU (CUPTI, tests/gpu/kernel_trace.c as trace-graph.sh builds it), then per run
# of checks the medians of a check's kernels: the span from its first kernel's start to its
# last one's end, the GPU busy and idle inside it (idle: no kernel running, the host's launches
# or round trips behind), the host's time between checks, and what each kernel name adds to the
# GPU's busy time (its end minus the later of its start and the latest end before it, summed
# over its launches). Why: a check costs
# 1.7-2.1 decode steps (docs/lab.md, session 72) and ncu, a kernel at a time at base clocks,
# cannot say whether launches, round trips or the kernels themselves make the difference.
# Usage: bash tests/gpu/trace-checks.sh [PRESET [DEPTHS [--against VAR=VALUE]]]   (qwen25_3b
# 48,8192; the CSV, gzipped, goes to $OUT or ./device-logs)
set -uo pipefail
out=${OUT:-device-logs}; mkdir -p "$out"
source tests/gpu/kernel-trace-build.sh
timeout 400 env DV2_TRACE_OUT=/tmp/check-trace.csv LD_PRELOAD=/tmp/libkernel_trace.so \
  "${BENCH:-.device/examples/bench}" --checks "${1:-qwen25_3b}" "${2:-48,8192}" "${@:3}" > "$out/checks-bench.txt" 2>&1
echo "bench rc=$?"; cat "$out/checks-bench.txt"
gzip -c /tmp/check-trace.csv > "$out/check-trace.csv.gz"
python3 - /tmp/check-trace.csv <<'PY'
import csv, sys, statistics as st
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r["graph"] == "0"]
rows.sort(key=lambda r: int(r["start_ns"]))
# Eager kernels in groups, each from an embed_rows (a prefill chunk's first kernel, a CTA a
# row); a check is a group with argmax_logits in it, of k + 1 rows.
groups, cur = [], None
for r in rows:
    if r["name"] == "embed_rows":
        cur = []
        groups.append(cur)
    if cur is not None:
        cur.append(r)
t = lambda r, f: int(r[f]) / 1e3
checks = [(int(g[0]["grid"]) - 1, g) for g in groups if any(r["name"] == "argmax_logits" for r in g)]
# Runs of 24 checks (the bench's; with --against the engines' runs alternate, default first).
runs = []
for i, (k, g) in enumerate(checks):
    prev_end = t(checks[i - 1][1][-1], "end_ns") if i else None
    if not runs or runs[-1][0] != k or len(runs[-1][1]) == 24:
        runs.append((k, []))
    runs[-1][1].append((g, prev_end))
for k, run in runs:
    span, busy, gaps, launches, adds = [], [], [], [], {}
    for g, prev_end in run:
        start, last_end, b = t(g[0], "start_ns"), t(g[0], "start_ns"), 0.0
        per = {}
        for r in g:
            s, e = t(r, "start_ns"), t(r, "end_ns")
            add = max(0.0, e - max(s, last_end))
            b += add
            per[r["name"]] = per.get(r["name"], 0.0) + add
            last_end = max(last_end, e)
        span.append(last_end - start)
        busy.append(b)
        launches.append(len(g))
        if prev_end is not None:
            gaps.append(start - prev_end)
        for n, v in per.items():
            adds.setdefault(n, []).append(v)
    m = st.median
    print(f"k={k}: {len(run)} checks, {m(launches):.0f} kernels each; µs medians: span {m(span):.1f}, "
          f"GPU busy {m(busy):.1f}, idle inside {m(span) - m(busy):.1f}, host between checks "
          f"{m(gaps) if gaps else float('nan'):.1f}")
    for n, v in sorted(adds.items(), key=lambda kv: -m(kv[1]))[:12]:
        print(f"    {n:<28} adds {m(v):8.1f}")
PY
