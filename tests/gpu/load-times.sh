#!/usr/bin/env bash
# Load times for issue 31, on the GPU machine (after `tar xzf .dz/device.tgz`):
#   cold  = the file's pages evicted from the page cache (sync, then posix_fadvise DONTNEED on
#           every file: no root needed; `fincore` shows what stayed resident where it exists)
#           and an empty kernel cache (DV2_CACHE_DIR pointed at a new directory; and
#           CUDA_CACHE_DISABLE=1, or NVRTC 12.9+ serves what an earlier process on the machine
#           compiled from the driver's compute cache: docs/lab.md, session 62);
#   warm  = the same loads again, pages and compiled kernels cached.
# Each `bench --load` line splits a load into the read (parse, codes taken or re-quantized)
# and the device part (allocation, upload, kernels, warm-up), then `load_file` loads as a
# host does (dv2_load).
# Usage: bash tests/gpu/load-times.sh WORK gguf3b|bnb3b|bnb32b ...   (WORK: a scratch dir)
set -euo pipefail
work=${1:?usage: load-times.sh WORK gguf3b|bnb3b|bnb32b ...}
shift
ex=.device/examples
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64
mkdir -p "$work"
# The first CUDA context of a fresh machine also initializes the GPU (persistence mode off).
nvidia-smi --query-gpu=name,persistence_mode --format=csv,noheader || true

evict() {
  sync
  python3 - "$1" <<'PY'
import os, sys
root = sys.argv[1]
paths = [root] if os.path.isfile(root) else [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
for p in paths:
    fd = os.open(p, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
print(f"evicted {len(paths)} file(s) under {root} from the page cache")
PY
  if command -v fincore > /dev/null; then
    if [[ -d $1 ]]; then fincore "$1"/*; else fincore "$1"; fi
  fi
}

# cold then warm loads of PATH, REPS warm ones
measure() {
  local path=$1 reps=$2 cache
  cache=$(mktemp -d "$work/kernels-XXXX")
  evict "$path"
  echo "== cold: $path (page cache evicted, kernel cache empty: $cache)"
  CUDA_CACHE_DISABLE=1 DV2_CACHE_DIR=$cache "$ex/bench" --load "$path" 1
  # What the cold load compiled into its new cache (session 30: the bnb directory's cold load
  # showed no compile time, NVRTC's own cache being the likely reason, session 62).
  echo "kernel cache after the cold load:"; ls -l "$cache"
  echo "== warm: $path (pages and kernels cached)"
  DV2_CACHE_DIR=$cache "$ex/bench" --load "$path" "$reps"
}

for what in "$@"; do
  case $what in
    gguf3b)
      [[ -e $work/q3b.gguf ]] || "$ex/synth_gguf" qwen25_3b 1 "$work/q3b.gguf"
      measure "$work/q3b.gguf" 3
      ;;
    bnb3b)
      [[ -e $work/q3b-bnb ]] || "$ex/convert_bnb" --synthetic qwen25_3b 1 "$work/q3b-bnb"
      measure "$work/q3b-bnb" 3
      ;;
    bnb32b)
      [[ -e $work/q32b-bnb ]] || "$ex/convert_bnb" --synthetic qwen25_32b 1 "$work/q32b-bnb"
      measure "$work/q32b-bnb" 2
      ;;
    *)
      echo "load-times.sh: unknown model '$what' (gguf3b, bnb3b, bnb32b)" >&2
      exit 2
      ;;
  esac
done
