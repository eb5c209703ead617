#!/usr/bin/env python3
"""The hottest loop of a kernel by its SASS: the longest span closed by a backward branch, its
instruction count and opcodes. Runs here (no GPU): the lab's "the loop 447 -> 431 instructions"
come from it.

Needs cuobjdump and nvdisasm on PATH (pip install --target DIR nvidia-cuda-cuobjdump
nvidia-cuda-nvdisasm: 13.2.51 read the lab's sm_90 cubins; their bin folders under
DIR/nvidia/cu13/bin). The cubin:
`cargo run --release --example kernel_sizes -- --cubin PATH NAME` (with the DV2_* settings of
the build to read).

Usage: python3 tests/gpu/sass-loop.py CUBIN KERNEL
"""
import collections
import re
import subprocess
import sys


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[-1])
    cubin, kernel = sys.argv[1:]
    sass = subprocess.run(["cuobjdump", "-sass", "-fun", kernel, cubin], capture_output=True, text=True,
                          check=True).stdout
    # "/*2c50*/  @!P0 HMMA.16816.F32 R52, ..." -> (address, opcode, text)
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z0-9_]+)(\S*)(.*)", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(2) + m.group(3) + m.group(4)))
    if not ins:
        sys.exit(f"no SASS for {kernel} in {cubin}")
    loop = None
    for addr, op, text in ins:
        target = re.search(r"\bBRA (?:!?U?P[0-9T], )?(0x[0-9a-f]+)", text)
        if op == "BRA" and target and int(target.group(1), 16) < addr:
            start = int(target.group(1), 16)
            if loop is None or addr - start > loop[1] - loop[0]:
                loop = (start, addr)
    print(f"{kernel}: {len(ins)} instructions")
    if loop is None:
        print("no backward branch: no loop")
        return
    body = [op for addr, op, _ in ins if loop[0] <= addr <= loop[1]]
    print(f"longest loop {loop[0]:#x}..{loop[1]:#x}: {len(body)} instructions")
    for op, n in collections.Counter(body).most_common():
        print(f"  {n:5} {op}")


if __name__ == "__main__":
    main()
