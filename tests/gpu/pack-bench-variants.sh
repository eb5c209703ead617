#!/usr/bin/env bash
# Runs here (no GPU), after ../shared/tools/device-pack: builds the bench example of each named
# git revision (a branch, a commit) in a worktree of its own and copies it into
# .device/examples/bench-<name> ('/' in a name becomes '-'), so that one device call can time
# revisions that have no switch between them (tests/gpu/compare-benches.sh). The worktrees share
# one target folder under /tmp, so a second revision rebuilds only what differs.
# Usage: bash tests/gpu/pack-bench-variants.sh REV [REV...]
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
[[ -d .device/examples ]] || { echo "run ../shared/tools/device-pack first"; exit 1; }
target=/tmp/dv2-bench-variants-target
for rev in "$@"; do
  name=${rev//\//-}
  tree=/tmp/dv2-bench-variant-$name
  git worktree remove --force "$tree" 2>/dev/null || true
  git worktree add --detach "$tree" "$rev" >/dev/null
  (cd "$tree" && CARGO_TARGET_DIR=$target cargo build --release --example bench --quiet)
  cp "$target/release/examples/bench" ".device/examples/bench-$name"
  git worktree remove --force "$tree"
  echo "packed .device/examples/bench-$name ($(git rev-parse --short "$rev"))"
done
