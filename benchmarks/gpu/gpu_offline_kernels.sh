#!/bin/bash
# Kernels built without a GPU (issue 30), checked on the GPU host. Needs the artifact built on a
# host without a GPU, with the CUDA build of the GPU host's torch and triton (docs/commands.md):
#   titan-build --flavor debug --dtype bf16 --kernels --gpu h100 --out artifacts/offline-debug
#   titan-build --flavor debug --dtype bf16 --kernels --gpu h200 --out artifacts/offline-debug
# carried here as artifacts/offline-debug ($OFFLINE). On one GPU:
#  0. this GPU's properties against the --gpu record of its model,
#  1. the same artifact built here the existing way (titan-build --kernels on this GPU),
#  2. the two artifacts' kernels for this GPU compared byte for byte (plan files; which part
#     differs where they do),
#  3. titan-verify --deterministic of the offline artifact from an empty cache, its kernels
#     trusted: bitwise against eager, with every region from the artifact (the fusion line), and
#     the same for the GPU-built one.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh"
export TITAN_CACHE_DIR=$OUT/cache TITAN_KEY_FILE=$OUT/cache.key
OFFLINE=${OFFLINE:-artifacts/offline-debug}
BUILD="--flavor debug --dtype bf16"
install_titan
[ -f "$OFFLINE/manifest.json" ] || { echo "error: no offline artifact at $OFFLINE: build it without a GPU and carry it (see the top of this script)"; exit 2; }
python benchmarks/gpu/offline_kernels_compare.py device; echo "device record: exit $?"
rm -rf "$OUT/cache" artifacts/gpu-debug
titan-build $BUILD --kernels --out artifacts/gpu-debug > "$OUT/build-gpu.txt" 2>&1
echo "build --kernels on this GPU: exit $? $(grep '^kernels:' "$OUT/build-gpu.txt") [$(elapsed) s]"
python benchmarks/gpu/offline_kernels_compare.py compare artifacts/gpu-debug "$OFFLINE"; echo "compare: exit $?"
for art in "$OFFLINE" artifacts/gpu-debug; do
  name=$(basename "$art")
  TITAN_CACHE_DIR=$OUT/empty-$name timeout 300 titan-verify "$art" --steps 5 --device cuda --deterministic \
    --trust-unsigned-kernels > "$OUT/verify-$name.txt" 2>&1
  echo "verify $name: exit $? | $(grep -m1 '^fusion:' "$OUT/verify-$name.txt") | $(tail -1 "$OUT/verify-$name.txt") [$(elapsed) s]"
done
echo "done at $(elapsed) s"
