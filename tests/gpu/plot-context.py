#!/usr/bin/env python3
"""Draws `bench --context`'s JSON: decode tok/s against context depth beside the bandwidth
floor (weights plus the KV bytes at that depth, over the measured bandwidth), and prefill tok/s.
Usage: python3 tests/gpu/plot-context.py CONTEXT.json OUT.png   (needs matplotlib)"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

data = json.load(open(sys.argv[1]))
rows = data["context"]
depth = [r["depth"] for r in rows]
fig, (dec, pre) = plt.subplots(1, 2, figsize=(11, 4.2))
dec.plot(depth, [r["tok_s"] for r in rows], "o-", label="decodev2 decode")
# The second sweep (bench --against; before it, always DV2_ATTN_LONG=0 as "v3_ms_per_token").
against = data.get("against", "DV2_ATTN_LONG=0")
key = "against_ms_per_token" if "against" in data else "v3_ms_per_token"
labels = {"DV2_ATTN_LONG=0": "attention v2 at every depth (DV2_ATTN_LONG=0)",
          "DV2_HOPPER=0": "the pre-Hopper path (DV2_HOPPER=0)"}
if all(key in r for r in rows):
    dec.plot(depth, [1e3 / r[key] for r in rows], "s:", color="C3", label=labels.get(against, against))
dec.plot(depth, [1e3 / r["floor_ms"] for r in rows], "--", label="bandwidth floor (weights + KV)")
dec.set_xscale("log", base=2)
dec.set_xlabel("context depth (tokens)")
dec.set_ylabel("decode tok/s")
dec.set_ylim(bottom=0)
dec.set_title("Qwen2.5-3B shape, NF4, H200: decode")
dec.legend()
dec.grid(alpha=0.3)
pre.plot(depth, [r["prefill_tok_s"] for r in rows], "o-", color="C2", label="decodev2 prefill")
pre.set_xscale("log", base=2)
pre.set_xlabel("prompt length (tokens)")
pre.set_ylabel("prefill tok/s")
pre.set_ylim(bottom=0)
pre.set_title("prefill (wall clock to the first token)")
pre.grid(alpha=0.3)
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)
print("wrote", sys.argv[2])
