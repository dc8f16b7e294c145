#!/bin/bash
# Kernels are part of the build (issue 16): on one GPU,
#  1. the second job on a host loads every kernel and compiles none,
#  2. an artifact built with --kernels, copied, runs on an empty cache and compiles none,
#  3. with N local ranks (N GPUs) and an empty store each kernel is compiled once (the fusion
#     line of rank 0 plus the store's kernel count),
# then the GPU tests of the trust model / kernels. Prints the fusion lines; results in $OUT.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh"
export TITAN_CACHE_DIR=$OUT/cache TITAN_KEY_FILE=$OUT/cache.key
install_titan
rm -rf "$OUT/cache" artifacts/kern-1b artifacts/kern-copy
titan-build --flavor 1B --dtype bf16 --seq-len 2048 --out artifacts/kern-1b > "$OUT/build.txt" 2>&1; echo "build: exit $? at $(elapsed) s"
for job in first second; do
  titan-run artifacts/kern-1b --steps 3 --device cuda > "$OUT/run-$job.txt" 2>&1
  echo "$job job: exit $? $(grep '^fusion:' "$OUT/run-$job.txt")"
done
titan-build --flavor 1B --dtype bf16 --seq-len 2048 --kernels --out artifacts/kern-1b > "$OUT/build-kernels.txt" 2>&1
echo "build --kernels: exit $? $(grep '^kernels:' "$OUT/build-kernels.txt")"
cp -r artifacts/kern-1b artifacts/kern-copy
TITAN_CACHE_DIR=$OUT/empty-cache titan-run artifacts/kern-copy --steps 3 --device cuda > "$OUT/run-copied.txt" 2>&1
echo "copied artifact, empty cache: exit $? $(grep '^fusion:' "$OUT/run-copied.txt")"
n=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$n" -ge 2 ]; then
  titan-build --flavor debug --dtype bf16 --dp-shard "$n" --out artifacts/kern-dp > "$OUT/build-dp.txt" 2>&1
  TITAN_CACHE_DIR=$OUT/cache-dp titan-run artifacts/kern-dp --steps 2 --device cuda > "$OUT/run-dp.txt" 2>&1
  echo "$n ranks, empty store: exit $? $(grep '^fusion:' "$OUT/run-dp.txt"); kernels stored: $(TITAN_CACHE_DIR=$OUT/cache-dp titan-cache ls | grep '^kernels')"
fi
python -m pytest -q -m gpu tests/gpu/test_gpu.py -k "kernel" 2>&1 | tail -3
echo "done at $(elapsed) s"
