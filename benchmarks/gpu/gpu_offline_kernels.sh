#!/bin/bash
# Kernels built without a GPU (issue 30), checked on the GPU host. Needs the artifacts built on a
# host without a GPU, with the CUDA build of the GPU host's torch and triton (docs/commands.md):
#   for g in h100 h200; do
#     titan-build --flavor debug --dtype bf16 --kernels --gpu $g --out artifacts/offline-debug
#     titan-build --flavor 1B --dtype bf16 --seq-len 2048 --kernels --gpu $g --out artifacts/offline-1b
#   done
# carried here under artifacts/ (a missing one is skipped; CASES="debug" runs that one only).
# On one GPU, for each:
#  0. this GPU's properties against the --gpu record of its model,
#  1. the same artifact built here the existing way (titan-build --kernels on this GPU),
#  2. the two artifacts' kernels for this GPU compared byte for byte (plan files; which part
#     differs where they do),
#  3. titan-verify --deterministic of the offline artifact from an empty cache, its kernels
#     trusted: bitwise against eager, every region from the artifact (its fusion line); then the
#     same for the GPU-built one.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh"
export TITAN_CACHE_DIR=$OUT/cache TITAN_KEY_FILE=$OUT/cache.key
install_titan
python benchmarks/gpu/offline_kernels_compare.py device; echo "device record: exit $?"
rm -rf "$OUT/cache"
for case in "debug|--flavor debug --dtype bf16" "1b|--flavor 1B --dtype bf16 --seq-len 2048"; do
  name=${case%%|*}; build=${case#*|}; offline=artifacts/offline-$name; here=artifacts/gpu-$name
  case " ${CASES:-debug 1b} " in *" $name "*) ;; *) continue;; esac
  [ -f "$offline/manifest.json" ] || { echo "== $name: no $offline (build it without a GPU and carry it): skipped"; continue; }
  echo "== $name"
  rm -rf "$here"
  titan-build $build --kernels --out "$here" > "$OUT/build-$name.txt" 2>&1
  echo "build --kernels on this GPU: exit $? $(grep '^kernels:' "$OUT/build-$name.txt") [$(elapsed) s]"
  python benchmarks/gpu/offline_kernels_compare.py compare "$here" "$offline"; echo "compare: exit $?"
  for art in "$offline" "$here"; do
    tag=$(basename "$art")
    TITAN_CACHE_DIR=$OUT/empty-$tag timeout 400 titan-verify "$art" --steps 5 --device cuda --deterministic \
      --trust-unsigned-kernels > "$OUT/verify-$tag.txt" 2>&1
    echo "verify $tag: exit $? | $(grep -m1 '^fusion:' "$OUT/verify-$tag.txt") | $(grep -m1 'bitwise equal' "$OUT/verify-$tag.txt") [$(elapsed) s]"
  done
done
echo "done at $(elapsed) s"
