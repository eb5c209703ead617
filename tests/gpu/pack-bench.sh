#!/usr/bin/env bash
# Builds examples/bench at each named git ref into .dz/bench-<ref> (slashes as dashes),
# stripped (~5 MB each; the kernels' sources are inside), so that one device call with
# `carry: [".dz"]` compares branches: `LD_LIBRARY_PATH=/usr/local/cuda/lib64 .dz/bench-<ref> --context`.
# Each ref builds in this tree (incrementally), which must have no uncommitted changes; the
# checkout it started on is restored, also on failure.
# Usage (here): bash tests/gpu/pack-bench.sh main wip/attn-long-8-warps
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
if [[ -n $(git status --porcelain --untracked-files=no) ]]; then
  echo "pack-bench: commit or stash the changes first" >&2
  exit 1
fi
start=$(git symbolic-ref -q --short HEAD || git rev-parse HEAD)
trap 'git checkout -q "$start"' EXIT
grep -qsx '/.dz/' .git/info/exclude || echo '/.dz/' >> .git/info/exclude
mkdir -p .dz
for ref in "$@"; do
  git checkout -q "$ref"
  cargo build -q --release --example bench
  out=.dz/bench-${ref//\//-}
  cp target/release/examples/bench "$out"
  strip "$out"
  echo "$ref ($(git rev-parse --short HEAD)) -> $out ($(du -h "$out" | cut -f1))"
done
