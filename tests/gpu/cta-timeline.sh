#!/usr/bin/env bash
# Runs on the GPU machine after ../shared/tools/device-pack: one graph step (the Qwen2.5-3B
# shape, or PRESET's) recorded CTA by CTA (DV2_CTA_TIMELINE=1: kernels/common.cuh,
# CTA_TIMELINE), then per kernel of a layer (median over the layers), in µs from the previous
# kernel's last CTA end: when its CTAs reach their PDL wait (first, 10th/50th/90th percentile,
# last; "early": the share that waited before the previous kernel ended), when the wait
# released them, and when they end; and whether the CTAs that end last are those with the low
# or the high indices (the scheduler places low ones first). A second table, per CTA from its
# start record: start to wait, wait to its release (how long it held its first weights with
# nothing to do: o's 3.5 µs at the 32B shape, session 36), the slot's hand-over, release to
# end, how many SMs held its CTAs (the 32B shape's q/k/v: 112 of 132, two each, session 37),
# and the end by how many CTAs of its kernel its SM held.
# Why: which CTAs start late, wait and end last decides each kernel's share of the step
# (docs/lab.md, session 17: gate/up's rows skewed by start time; session 19: q/k/v's SMs that
# held two of its CTAs).
# A third table splits the long-context attention's CTAs (kernels/attention_long.cu marks) into
# phases.
# Usage: bash tests/gpu/cta-timeline.sh [DEPTH [PRESET]]   (the prompt's length, 48; the
# preset, qwen25_3b; switches from the environment; BENCH: the bench binary,
# .device/examples/bench by default, or a branch's from tests/gpu/pack-bench.sh, e.g.
# BENCH=.dz/bench-wip-x; the CSV goes to $OUT or ./device-logs)
set -uo pipefail
out=${OUT:-device-logs}; mkdir -p "$out"
depth=${1:-48}
preset=${2:-qwen25_3b}
export DV2_CACHE_DIR=/tmp/dv2-cache DV2_CTA_TIMELINE=1
export LD_LIBRARY_PATH="$PWD/.device/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
timeout 300 "${BENCH:-.device/examples/bench}" --cta-timeline "$out/cta-timeline.csv" "$depth" "$preset" || exit 1
python3 - "$out/cta-timeline.csv" <<'PY'
import csv, sys, statistics as st
grids = {}
for r in csv.DictReader(open(sys.argv[1])):
    g = grids.setdefault(r["grid_id"], {"ctas": int(r["ctas"]), "wait": [], "end": []})
    if r["kind"] == "0":
        g["wait"].append((int(r["cta"]), int(r["t0"]), int(r["t1"])))
    elif r["kind"] == "1":
        g["end"].append((int(r["cta"]), int(r["t0"])))
order = sorted((g for g in grids.values() if g["wait"]), key=lambda g: min(w[1] for w in g["wait"]))
print(f"{len(order)} kernels, {sum(len(g['wait']) for g in order)} CTA waits, {sum(len(g['end']) for g in order)} CTA ends")
# The last instant of a kernel: its last CTA end, or (kernels without end records) its last release.
last = lambda g: max(e[1] for e in g["end"]) if g["end"] else max(w[2] for w in g["wait"])
pct = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]
names = ["q/k/v", "attention", "o", "gate/up", "down"]
rows = {}
# The step: ring_reset and embed_row (one CTA each), 5 kernels a layer, lm_head last.
start = next(i for i, g in enumerate(order) if g["ctas"] > 1)
span = (len(order) - 1 - start) // 5 * 5
if span != len(order) - 1 - start:
    print(f"note: {len(order) - 1 - start} kernels between embed_row and lm_head, not 5 a layer")
for i in range(max(start, 1), start + span):
    g, prev = order[i], order[i - 1]
    t = last(prev)
    waits = [(w[1] - t) / 1e3 for w in g["wait"]]
    rel = [(w[2] - t) / 1e3 for w in g["wait"]]
    ends = sorted(g["end"], key=lambda e: e[1])
    row = {"waits": waits, "first": min(waits), "p10": pct(waits, .1), "p50": pct(waits, .5), "p90": pct(waits, .9),
           "lastw": max(waits), "early": sum(x < 0 for x in waits) / len(waits), "release": min(rel)}
    if ends:
        e = [(x[1] - t) / 1e3 for x in ends]
        half = g["ctas"] // 2
        lo = [(x[1] - t) / 1e3 for x in ends if x[0] < half]
        hi = [(x[1] - t) / 1e3 for x in ends if x[0] >= half]
        row.update(end50=pct(e, .5), end90=pct(e, .9), endmax=max(e), lo=st.median(lo) if lo else 0.0,
                   hi=st.median(hi) if hi else 0.0, lastcta=ends[-1][0])
    rows.setdefault((i - start) % 5, []).append((g["ctas"], row))
print(f"{'kernel':<16} {'CTAs':>5} {'first':>6} {'p10':>6} {'p50':>6} {'p90':>6} {'last':>6} {'early':>6} {'release':>8} "
      f"{'end p50':>8} {'p90':>6} {'max':>6} {'low half':>9} {'high half':>9}")
for pos, rs in sorted(rows.items()):
    rs = [r for r in rs if "end50" in r[1]] or rs
    ctas = rs[0][0]
    m = lambda k: st.median(r[1].get(k, 0.0) for r in rs)
    print(f"{names[pos]:<16} {ctas:>5} {m('first'):>6.2f} {m('p10'):>6.2f} {m('p50'):>6.2f} {m('p90'):>6.2f} "
          f"{m('lastw'):>6.2f} {m('early'):>6.2f} {m('release'):>8.2f} {m('end50'):>8.2f} {m('end90'):>6.2f} "
          f"{m('endmax'):>6.2f} {m('lo'):>9.2f} {m('hi'):>9.2f}")
PY
# Per CTA, from the start records (kind 2): start -> its wait, the time from the latest end of a
# previous-kernel CTA on its SM to its start (the slot's hand-over), release -> its end; and its
# end by how many CTAs of its kernel its SM held (an SM holding more ends later); on SMs that
# held two, how far apart the two ended (pair gap, median) and how often the lower-indexed one
# ended first (the 32B shape's SwiGLU: 8.7 µs, 0.99 — the warp scheduler's oldest-first, which
# rows handed out as CTAs ask did not turn into a shorter kernel: docs/lab.md, session 38). A CTA keeps
# its records in shared memory and appends them at its end with one atomic (since session 37:
# before, each record's atomic stalled the CTA's thread 0 a round trip, at its start, after its
# wait and at each phase mark, so timelines before then run long in those places).
python3 - "$out/cta-timeline.csv" <<'PY'
import csv, sys, statistics as st
grids = {}
for r in csv.DictReader(open(sys.argv[1])):
    g = grids.setdefault(r["grid_id"], {"ctas": int(r["ctas"]), "ev": {}})
    g["ev"].setdefault(int(r["cta"]), {})[r["kind"]] = (int(r["sm"]), int(r["t0"]), int(r["t1"]))
order = sorted((g for g in grids.values() if any("0" in e for e in g["ev"].values())),
               key=lambda g: min(e["0"][1] for e in g["ev"].values() if "0" in e))
start = next(i for i, g in enumerate(order) if g["ctas"] > 1)
names = ["q/k/v", "attention", "o", "gate/up", "down"]
p50 = lambda xs: st.median(xs) if xs else float("nan")
p90 = lambda xs: sorted(xs)[int(0.9 * len(xs))] if xs else float("nan")
print(f"{'kernel':<10} {'start->wait':>11} {'wait->release':>13} {'slot->start':>11} {'release->end p50':>16} {'p90':>6} {'SMs':>4} {'pair gap':>8} {'low 1st':>7}   end p50 by CTAs on the SM")
for pos in range(5):
    a, held_back, b, w, by, sms = [], [], [], [], {}, []
    gaps, low_first = [], []  # SMs that held two of the kernel's CTAs: their ends apart, which ended first
    for i in range(start + pos, len(order) - 1, 5):
        if i == start:
            continue  # the first q/k/v follows embed_row
        prev, cur = order[i - 1], order[i]
        release = min(e["0"][2] for e in cur["ev"].values() if "0" in e)
        ends_on = {}
        for e in prev["ev"].values():
            if "1" in e:
                ends_on.setdefault(e["1"][0], []).append(e["1"][1])
        held = {}
        for e in cur["ev"].values():
            if "2" in e:
                held[e["2"][0]] = held.get(e["2"][0], 0) + 1
        if held:
            sms.append(len(held))
        pairs = {}
        for c, e in cur["ev"].items():
            if "1" in e and "2" in e:
                pairs.setdefault(e["2"][0], []).append((e["1"][1], c))
        for two in pairs.values():
            if len(two) == 2:
                (t_a, c_a), (t_b, c_b) = sorted(two)
                gaps.append((t_b - t_a) / 1e3)
                low_first.append(c_a < c_b)
        for e in cur["ev"].values():
            if "2" not in e or "0" not in e:
                continue
            sm, t_start = e["2"][0], e["2"][1]
            a.append((e["0"][1] - t_start) / 1e3)
            held_back.append((e["0"][2] - e["0"][1]) / 1e3)
            before = [t for t in ends_on.get(sm, []) if t <= t_start]
            if before:
                b.append((t_start - max(before)) / 1e3)
            if "1" in e:
                w.append((e["1"][1] - release) / 1e3)
                by.setdefault(held[sm], []).append((e["1"][1] - release) / 1e3)
    if not a:
        continue
    by_s = "  ".join(f"{k}: {p50(v):.2f} ({len(v)})" for k, v in sorted(by.items()))
    low = f"{sum(low_first) / len(low_first):.2f}" if low_first else "nan"
    print(f"{names[pos]:<10} {p50(a):>11.2f} {p50(held_back):>13.2f} {p50(b):>11.2f} {p50(w):>16.2f} {p90(w):>6.2f} {p50(sms):>4.0f} {p50(gaps):>8.2f} {low:>7}   {by_s}")
PY
# The long-context attention's CTAs (those with phase marks), per CTA from the release of its
# PDL wait: prologue done (RoPE of q and the live k/v, kind 3), tiles done (4), the CTA's warps
# merged (6), the cluster's merge read (5), end (1; the cross-cluster merge where more than
# one cluster ran); medians over the layers' CTAs, and the kernel's span from its first release
# to its last end; then per
# cluster how far apart its CTAs reach the merge, how long the merge's barrier and reads take
# after the last of them, and from there to the cluster's end.
python3 - "$out/cta-timeline.csv" <<'PY'
import csv, sys, statistics as st
grids = {}
for r in csv.DictReader(open(sys.argv[1])):
    g = grids.setdefault(r["grid_id"], {})
    g.setdefault(int(r["cta"]), {})[r["kind"]] = int(r["t0"]), int(r["t1"])
phases = {k: [] for k in "34651"}
spans, ctas = [], []
arrivals, to_read, to_end = [], [], []  # per cluster (8 CTAs, ATTNL_RANKS, by CTA index)
for g in grids.values():
    ran = {c: e for c, e in g.items() if all(k in e for k in "034651")}
    if not ran:
        continue
    ctas.append(len(ran))
    for e in ran.values():
        release = e["0"][1]
        for k in phases:
            phases[k].append((e[k][0] - release) / 1e3)
    spans.append((max(e["1"][0] for e in ran.values()) - min(e["0"][1] for e in ran.values())) / 1e3)
    clusters = {}
    for c, e in ran.items():
        clusters.setdefault(c // 8, []).append(e)
    for es in clusters.values():
        last_arrival = max(e["6"][0] for e in es)
        arrivals.append((last_arrival - min(e["6"][0] for e in es)) / 1e3)
        to_read.append((min(e["5"][0] for e in es) - last_arrival) / 1e3)
        to_end.append((max(e["1"][0] for e in es) - max(e["5"][0] for e in es)) / 1e3)
if spans:
    print(f"long-context attention: {len(spans)} launches, {st.median(ctas)} CTAs ran a launch; "
          f"µs from a CTA's release (median): prologue {st.median(phases['3']):.2f}, tiles {st.median(phases['4']):.2f}, "
          f"warps merged {st.median(phases['6']):.2f}, cluster merge read {st.median(phases['5']):.2f}, end {st.median(phases['1']):.2f}; "
          f"a launch from its first release to its last end {st.median(spans):.2f}")
    print(f"  per cluster (median): its CTAs' arrivals at the merge spread over {st.median(arrivals):.2f} µs; "
          f"last arrival to the first merge read done {st.median(to_read):.2f}; last read to the last end {st.median(to_end):.2f}")
else:
    print("no long-context attention CTAs in this step (DV2_ATTN_LONG=0, or a device or shape without it)")
PY
