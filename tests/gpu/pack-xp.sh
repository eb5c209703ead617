#!/usr/bin/env bash
# Runs here (no GPU): builds the bench example and the cuda_gemv test of a git revision that
# holds experiments behind DV2_X_* switches (a branch, a commit) and packs them, stripped, into
# .dx/xp/, for tests/gpu/xp-against.sh on the GPU machine (device call with carry [".dx"]).
# GATES=1 packs its cuda_gates test too (the oracle gates under a switch). XP=.dx/xp-NAME packs
# into that folder instead (several revisions carried in one call; xp-against.sh takes the same).
# The worktree stays at /tmp/dv2-xp (the binaries' compiled-in paths point there; the device
# script links it to the checkout).
# Usage: [XP=.dx/xp] [GATES=1] bash tests/gpu/pack-xp.sh REV
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
rev=${1:?usage: pack-xp.sh REV}
tree=/tmp/dv2-xp target=/tmp/dv2-xp-target
grep -qsx '/.dx/' .git/info/exclude || echo '/.dx/' >> .git/info/exclude
git worktree remove --force "$tree" 2>/dev/null || true
git worktree add --detach "$tree" "$rev" >/dev/null
(cd "$tree" && CARGO_TARGET_DIR=$target cargo build --release --example bench --quiet)
# The path of the revision's test binary named $1, built.
test_binary() {
  (cd "$tree" && CARGO_TARGET_DIR=$target cargo test --release --no-run --test "$1" \
    --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$1")
}
xp=${XP:-.dx/xp}
rm -rf "$xp" && mkdir -p "$xp"
cp "$target/release/examples/bench" "$xp/"
cp "$(test_binary cuda_gemv)" "$xp/cuda_gemv"
[[ ${GATES:-0} == 1 ]] && cp "$(test_binary cuda_gates)" "$xp/cuda_gates"
strip "$xp"/*
git -C "$tree" rev-parse --short HEAD > "$xp/REV"
echo "packed $xp from $rev ($(cat "$xp/REV")): $(du -sh "$xp" | cut -f1)"
