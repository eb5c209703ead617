"""Session 63: the CPU backend's decode speed on a model file (64 greedy steps after a short
prompt). From the repository root: DV2_LIB=target/release/libdecodev2.so python3 THIS MODEL"""
import sys, time
sys.path.insert(0, "python")
import decodev2
m = sys.argv[1]
with decodev2.Engine.load(m, backend="cpu") as e:
    ids = e.tokenize("The capital of France is Paris. The capital of Germany is", add_special=True)
    t = time.perf_counter(); first = e.prefill(ids); tp = time.perf_counter() - t
    out = [first]
    t = time.perf_counter()
    for _ in range(64):
        out.append(e.step())
    dt = time.perf_counter() - t
    print(f"prompt {len(ids)} in {tp*1000:.0f} ms; 64 steps {dt:.3f} s = {64/dt:.1f} tok/s; ids hash {hash(tuple(out))}")
