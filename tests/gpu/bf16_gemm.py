"""The reference rate for docs/lab.md: torch's (cuBLAS) bf16 GEMM on the Qwen2.5-3B linear
shapes, Y[N, rows] = X[N, K] @ W[rows, K]^T, median of CUDA-event timings over 20 runs after
warm-up, random data. Run on the GPU machine: python3 tests/gpu/bf16_gemm.py [out.json]"""
import json
import sys

import torch

shapes = {"q/k/v": (2560, 2048), "o": (2048, 2048), "gate|up": (22016, 2048), "down": (2048, 11008)}
rows_out = []
torch.manual_seed(0)
for name, (rows, k) in shapes.items():
    w = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    for n in [16, 64, 256, 512, 1024, 2048]:
        x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            y = x @ w.t()
        times = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            y = x @ w.t()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        us = sorted(times)[len(times) // 2]
        tflops = 2 * rows * k * n / us / 1e6
        rows_out.append({"matrix": name, "rows": rows, "k": k, "n": n, "median_us": us, "tflops": tflops})
        print(f"{name:<8} N={n:<5} {us:9.2f} us {tflops:7.1f} TFLOP/s")
m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    m @ m
times = []
for _ in range(10):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    m @ m
    b.record()
    torch.cuda.synchronize()
    times.append(a.elapsed_time(b) * 1e3)
us = sorted(times)[len(times) // 2]
print(f"8192^3   {us:9.2f} us {2 * 8192**3 / us / 1e6:7.1f} TFLOP/s (torch {torch.__version__})")
if len(sys.argv) > 1:
    json.dump(rows_out, open(sys.argv[1], "w"), indent=1)
