#!/usr/bin/env bash
# Download the peer rows' wheels pinned in benchmarks/peer_wheels.txt into .whl/ (git-ignored),
# for the GPU host (CPython 3.12, x86-64 Linux), with their hashes checked. Run once here, before
# a device call that carries .whl. The repository root's .gitignore lists /.whl/; in a main
# checkout (.git a directory) this also adds it to .git/info/exclude, as the device tool asks.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .git ]; then
  mkdir -p .git/info
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
fi
python3 -m pip download -q --no-deps --only-binary=:all: --require-hashes -r benchmarks/peer_wheels.txt \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl
du -ch .whl/*.whl | tail -1
