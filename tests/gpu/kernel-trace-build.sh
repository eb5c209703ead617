# Sourced by trace-graph.sh and trace-checks.sh on the GPU machine: the environment their bench
# runs in (the packed library, CUPTI on the library path, the kernel cache) and the CUPTI tracer
# tests/gpu/kernel_trace.c built into /tmp/libkernel_trace.so, to LD_PRELOAD into the bench.
export DV2_CACHE_DIR=/tmp/dv2-cache
export LD_LIBRARY_PATH="$PWD/.device/lib:/usr/local/cuda/lib64:/usr/local/cuda/extras/CUPTI/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
header=$(find /usr/local/cuda/ -name cupti.h 2>/dev/null | head -1)
libfile=$(find /usr/local/cuda/ -name 'libcupti.so*' 2>/dev/null | sort | head -1)
[[ -n $header && -n $libfile ]] || { echo "CUPTI not found under /usr/local/cuda"; exit 1; }
cc -std=c11 -O2 -Wall -shared -fPIC -I"$(dirname "$header")" -I/usr/local/cuda/include tests/gpu/kernel_trace.c \
  "$libfile" -Wl,-rpath,"$(dirname "$libfile")" -o /tmp/libkernel_trace.so || exit 1
