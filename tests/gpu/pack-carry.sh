#!/usr/bin/env bash
# Packs what ../shared/tools/device-pack built into .dz/device.tgz, stripped: the packed
# binaries pass the 64 MiB a device call carries (90 MB at session 22), the tarball does not
# (~35 MB). Then, in a device call with `carry: [".dz"]`, run-on-device.sh unpacks it itself.
# Usage (here, after device-pack): bash tests/gpu/pack-carry.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qsx '/.dz/' .git/info/exclude || echo '/.dz/' >> .git/info/exclude
strip .device/tests/* .device/examples/* .device/lib/*.so
mkdir -p .dz
tar czf .dz/device.tgz .device
echo "packed $(du -h .dz/device.tgz | cut -f1) in .dz/device.tgz"
