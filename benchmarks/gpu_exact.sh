#!/usr/bin/env bash
# GPU-host run for the default passes with exact fusion, on 4 GPUs, in one call:
#  1. titan-verify (bitwise vs eager, CUDA graphs, kernels generated here) of a debug bf16
#     dp-shard 2 x tp 2 artifact (DEBUG=1), then of the 8B LAYOUTS (10 steps, deterministic kernels);
#  2. the side-by-side benchmark (MODES) of the 8B LAYOUTS at seq 8192.
# The 8B artifacts (default passes, and --fuse when MODES has titan-fuse) are built first, in
# the background, into one cache: the benchmark's own titan-build calls are then cache hits,
# and the verify runs fill the kernel store.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/titan-gpu}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TITAN_CACHE_DIR=${TITAN_CACHE_DIR:-/tmp/titan-cache}
LAYOUTS=${LAYOUTS:-fsdp4 tp4}
MODES=${MODES:-eager,compile,titan,titan-fuse}
t_start=$(date +%s)
elapsed() { echo $(( $(date +%s) - t_start )); }
flags() { case $1 in tp4) echo --tp 4;; fsdp4) echo --dp-shard 4;; dp2tp2) echo --dp-shard 2 --tp 2;; dp2tp4) echo --dp-shard 2 --tp 4;; esac; }
build8b() {
  local name=$1; shift
  titan-build --model llama3 --dtype bf16 --jobs 8 --out "artifacts/$name" "$@" > "$OUT/build-$name.txt" 2>&1
  echo "built $name: exit $? at $(elapsed) s"
}
wait_for() { until grep -q "built $1:" "$OUT/builds.txt" 2>/dev/null; do sleep 2; done; }
(
  for l in $LAYOUTS; do
    build8b "$l" $(flags "$l") &
    case $MODES in *titan-fuse*) build8b "$l-fuse" $(flags "$l") --fuse & ;; esac
  done
  wait
) > "$OUT/builds.txt" 2>&1 &
if [ "${DEBUG:-1}" = 1 ]; then
  titan-build --flavor debug --dtype bf16 --dp-shard 2 --tp 2 --out artifacts/debug-dp2tp2 > /dev/null 2>&1
  timeout 150 titan-verify artifacts/debug-dp2tp2 --steps 10 --device cuda > "$OUT/verify-debug.txt" 2>&1
  echo "== verify debug bf16 dp-shard 2 x tp 2: $(grep -m1 '^fusion:' "$OUT/verify-debug.txt") | $(tail -1 "$OUT/verify-debug.txt") [$(elapsed) s]"
fi
for name in $LAYOUTS; do
  wait_for "$name"
  timeout 200 titan-verify "artifacts/$name" --steps 10 --deterministic > "$OUT/verify-8b-$name.txt" 2>&1
  echo "== verify 8B $name default passes --deterministic: $(grep -m1 '^fusion:' "$OUT/verify-8b-$name.txt") | $(tail -1 "$OUT/verify-8b-$name.txt") [$(elapsed) s]"
done
wait; cat "$OUT/builds.txt"
timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/train_bench.py $(for l in $LAYOUTS; do echo --layout "$l"; done) \
  --steps 12 --modes "$MODES" --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
echo "== bench exit $? [$(elapsed) s]"
grep -h "^fusion:\|FAILED" "$OUT/bench.txt"
grep -v "^\[rank\|^W1\|^I1" "$OUT/bench.txt" | tail -10
