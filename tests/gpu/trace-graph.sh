#!/usr/bin/env bash
# Runs on the GPU machine after ../shared/tools/device-pack: every kernel of the decode graph's
# replays timed on the GPU (CUPTI activity records, tests/gpu/kernel_trace.c preloaded into the
# bench), then the steps of the model's graph summed per kernel: mean duration, and the
# mean gap from the previous kernel's end to its start (negative: it started while the previous
# one ran, as programmatic dependent launch allows), the mean increment (its end minus the
# previous kernel's end: what it adds to the step), and one layer's timeline. What the step's
# time is made of inside the graph, which ncu (one kernel at a time) cannot show. First, over
# every step of the graph: the steps' spread (mean, p10, median, p90) and the idle time between
# replays, what a bench's ms/token holds beyond the steps' median.
# Usage: bash tests/gpu/trace-graph.sh [bench arguments]   (switches from the environment; the
# full CSV, gzipped, goes to $OUT or ./device-logs). The arguments replace the default bench run
# (the 3B shape's decode table), e.g. `--context qwen25_32b 48` for the 32B shape's graph;
# BENCH=<binary> traces another build; TRACE_PICK=first takes the first graph with the most
# kernels a step instead of the last (a --context sweep captures its DV2_ATTN_LONG=0 engine last);
# TRACE_PICK=all takes every such graph in the order of capture (`--context PRESET 48 --against
# VAR=VALUE`: the default engine's, then the other's, timed in the same minutes) and ends with
# their steps' medians side by side: a comparison of two settings on the GPU's clock.
set -uo pipefail
out=${OUT:-device-logs}; mkdir -p "$out"
source tests/gpu/kernel-trace-build.sh
args=("$@")
[[ $# -gt 0 ]] || args=(--skip-kernels --skip-variants --rows none)
# The preload goes to the bench alone: timeout's own exit would rewrite the file empty.
timeout 400 env DV2_TRACE_OUT=/tmp/kernel-trace.csv LD_PRELOAD=/tmp/libkernel_trace.so \
  "${BENCH:-.device/examples/bench}" "${args[@]}" > "$out/trace-bench.txt" 2>&1
echo "bench rc=$?"; grep -E "^  qwen25|^ +[0-9]+ |kernel_trace" "$out/trace-bench.txt"
gzip -c /tmp/kernel-trace.csv > "$out/kernel-trace.csv.gz"
python3 - /tmp/kernel-trace.csv "${TRACE_PICK:-last}" <<'PY'
import csv, sys, statistics as st
graphs = {}
for r in csv.DictReader(open(sys.argv[1])):
    if r["graph"] != "0":
        graphs.setdefault(r["graph"], []).append(r)
def steps_of(rows):
    k = sorted(rows, key=lambda r: int(r["start_ns"]))
    # A step starts at its embed_row (its commit may be commit_step or inside lm_head's kernel).
    starts = [i for i, r in enumerate(k) if r["name"] == "embed_row"]
    return [k[a:b] for a, b in zip(starts, starts[1:])]
def pct(v, q):
    v = sorted(v)
    return v[round((len(v) - 1) * q)]
def spread(g, steps):
    # Every step of the graph, not only the last 100: whether the bench's mean per token
    # (ms/token over whole chunks) sits above the steps' median because of a slow tail (the
    # clocks under the power cap) or because of time between the replays.
    span = [t(s[-1], "end_ns") - t(s[0], "start_ns") for s in steps]
    print(f"graph {g}: all {len(span)} steps, first start to last end, µs: mean {st.mean(span):.1f}, "
          f"p10 {pct(span, 0.1):.1f}, median {st.median(span):.1f}, p90 {pct(span, 0.9):.1f}, max {max(span):.1f}")
    # Idle between a step's last end and the next step's first start: within a step_n chunk
    # (the host queued the replays ahead) and at the chunks' and requests' edges (over 100 µs).
    idle = [t(b[0], "start_ns") - t(a[-1], "end_ns") for a, b in zip(steps, steps[1:])]
    inside = [x for x in idle if x <= 100]
    edges = [x for x in idle if x > 100]
    if inside:
        print(f"  idle between replays, µs: {len(inside)} within chunks, median {st.median(inside):.2f}, "
              f"mean {st.mean(inside):.2f}, max {max(inside):.2f}; {len(edges)} over 100 µs (chunk and request edges)"
              + (f", median {st.median(edges):.0f}" if edges else ""))
def summary(last, steps):
    span = [t(s[-1], "end_ns") - t(s[0], "start_ns") for s in steps]
    medians[last] = st.median(span)
    print(f"graph {last}: {len(steps)} steps of {n} kernels; first start to last end, median {medians[last]:.1f} µs")
    # Per position in the step: duration and gap to the previous kernel's end, median over steps.
    dur = [st.median(t(s[i], "end_ns") - t(s[i], "start_ns") for s in steps) for i in range(n)]
    gap = [st.median(t(s[i], "start_ns") - (t(s[i - 1], "end_ns") if i else t(s[0], "start_ns")) for s in steps) for i in range(n)]
    names = [steps[-1][i]["name"] for i in range(n)]
    # What each kernel adds to the step: its end minus the previous kernel's end (with PDL a
    # kernel starts early, so its duration includes waiting; the increments sum to the step).
    inc = [0.0] + [st.median(t(s[i], "end_ns") - t(s[i - 1], "end_ns") for s in steps) for i in range(1, n)]
    print(f"{'kernel':<28} {'per step':>8} {'mean µs':>8} {'sum µs':>8} {'mean gap µs':>12} {'increment µs':>13} {'sum':>7}")
    for name in dict.fromkeys(names):
        idx = [i for i in range(n) if names[i] == name]
        d, e = sum(dur[i] for i in idx), sum(inc[i] for i in idx)
        print(f"{name[:28]:<28} {len(idx):>8} {d / len(idx):>8.2f} {d:>8.1f} {sum(gap[i] for i in idx) / len(idx):>12.2f} {e / len(idx):>13.2f} {e:>7.1f}")
    print(f"sum of durations {sum(dur):.1f} µs, of gaps {sum(gap):.1f} µs")
    mid = n // 2
    first = max(i for i in range(mid) if "qkv" in names[i] or names[i].startswith("gemv3_store")) if any(
        "qkv" in x or x.startswith("gemv3_store") for x in names[:mid]) else mid
    print("one layer (median over steps, µs from its first kernel's start):")
    base = lambda s: t(s[first], "start_ns")
    for i in range(first, min(n, first + 6)):
        s0 = st.median(t(s[i], "start_ns") - base(s) for s in steps)
        e0 = st.median(t(s[i], "end_ns") - base(s) for s in steps)
        r = steps[-1][i]
        print(f"  {names[i][:28]:<28} {s0:7.2f} .. {e0:7.2f}  grid {r['grid']:>5} block {r['block']:>4} regs {r['regs']:>3} smem {r['smem']:>6}")
# The model's graph: the one with the most kernels a step (the most layers), the last such
# (TRACE_PICK=first: the first; all: every one, in the order of capture).
stepped = {g: s for g, s in ((g, steps_of(rows)) for g, rows in graphs.items()) if s}
if not stepped:
    sys.exit("no graph with two embed_row launches in the trace")
n = max(len(s[-1]) for s in stepped.values())
picked = [g for g in sorted(stepped, key=int) if len(stepped[g][-1]) == n]
picked = {"first": picked[:1], "all": picked}.get(sys.argv[2], picked[-1:])
t = lambda r, f: int(r[f]) / 1e3  # µs
medians = {}
for last in picked:
    spread(last, [s for s in stepped[last] if len(s) == n])
    summary(last, [s for s in stepped[last] if len(s) == n][-100:])
if len(picked) > 1:
    base = medians[picked[0]]
    print("the graphs' steps, median µs (first start to last end; the change against the first):")
    for g in picked:
        print(f"  graph {g}: {medians[g]:.1f}  ({(base / medians[g] - 1) * 100:+.2f}% speed)")
PY
