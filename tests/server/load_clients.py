#!/usr/bin/env python3
"""Load on `decodev2 serve` (listening at BASE_URL, process PID): 200 sequential completions and
a burst of 10 clients at once (the server queues them: one request runs at a time) to warm it,
then 200 more sequential ones and another burst. Every request must succeed, the concurrent
ones give the same text as the same request alone (greedy), and the server's resident memory
after the second round must be within 2 MiB of what it was after the first.

Usage: python3 tests/server/load_clients.py BASE_URL PID"""
import sys
import threading
import time

from openai import OpenAI

base, pid = sys.argv[1].rstrip("/"), int(sys.argv[2])
client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
model = client.models.list().data[0].id


def rss():
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def ask(i):
    return client.completions.create(model=model, prompt=f"{i} +", max_tokens=2, temperature=0).choices[0].text


def sequential(n):
    t = time.time()
    for i in range(n):
        ask(i % 7)
    return time.time() - t


def concurrent():
    """10 clients at once; their texts, the errors, the seconds."""
    results, errors = [None] * 10, []

    def client_thread(i):
        try:
            results[i] = ask(i)
        except Exception as err:  # noqa: BLE001 - counted below
            errors.append(repr(err))

    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(10)]
    t = time.time()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results, errors, time.time() - t


# Warm: the first 200, and a first burst (the server's worker threads grow to meet it).
first = sequential(200)
alone = [ask(i) for i in range(10)]
warm_burst = concurrent()
rss0 = rss()
second = sequential(200)
results, errors, together = concurrent()
rss1 = rss()
print(f"200 sequential in {first:.1f} s, 10 concurrent in {warm_burst[2]:.1f} s, then 200 sequential in "
      f"{second:.1f} s and 10 concurrent in {together:.1f} s; server RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB")
assert not warm_burst[1] and not errors, (warm_burst[1], errors)
assert warm_burst[0] == results == alone, (warm_burst[0], results, alone)
assert abs(rss1 - rss0) <= 2 << 20, (rss0, rss1)
print("all load checks passed")
