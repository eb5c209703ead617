#!/usr/bin/env python3
"""Per-request decode rate of `decodev2 serve` (listening at BASE_URL): completions of TOKENS
tokens, one request at a time, greedy and sampled, whole and streamed. A request's rate is its
completion tokens over its wall time at the client (HTTP, queue, prefill of a short prompt and
every step); a streamed one's also over the time from its first chunk to its last (the decode
alone). Standard library only (the GPU machine has no openai package). Prints a row per case:
the median of REPS requests.

Usage: python3 tests/server/rate_clients.py BASE_URL [TOKENS] [REPS]"""
import json
import statistics
import sys
import time
import urllib.request

base = sys.argv[1].rstrip("/")
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 128
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 5
model = json.load(urllib.request.urlopen(f"{base}/v1/models"))["data"][0]["id"]


def post(body):
    data = json.dumps({"model": model, "prompt": "the capital of France is", "max_tokens": tokens, **body})
    return urllib.request.urlopen(urllib.request.Request(
        f"{base}/v1/completions", data=data.encode(), headers={"Content-Type": "application/json"}))


def whole(body):
    t = time.perf_counter()
    reply = json.load(post(body))
    n = reply["usage"]["completion_tokens"]
    return n, n / (time.perf_counter() - t), None


def streamed(body):
    t = time.perf_counter()
    stamps = []
    with post({**body, "stream": True}) as r:
        for line in r:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                if json.loads(line[6:])["choices"][0].get("text"):
                    stamps.append(time.perf_counter())
    n = len(stamps)
    return n, n / (stamps[-1] - t), (n - 1) / (stamps[-1] - stamps[0])


print(f"{model}: {tokens} tokens a request, median of {reps}")
for name, body, call in [
    ("greedy", {"temperature": 0}, whole),
    ("sampled (T 1, top_p 0.9, seed)", {"temperature": 1.0, "top_p": 0.9, "seed": 5}, whole),
    ("greedy, streamed", {"temperature": 0}, streamed),
    ("sampled, streamed", {"temperature": 1.0, "top_p": 0.9, "seed": 5}, streamed),
]:
    call(body)  # the first request under a setting captures its graph
    runs = [call(body) for _ in range(reps)]
    counts = sorted({r[0] for r in runs})
    rate = statistics.median(r[1] for r in runs)
    decode = [r[2] for r in runs if r[2] is not None]
    extra = f", first to last chunk {statistics.median(decode):.1f} tok/s" if decode else ""
    print(f"  {name}: {rate:.1f} tok/s per request{extra} (completion tokens {counts})")
