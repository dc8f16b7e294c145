#!/usr/bin/env bash
# GPU-host run for the default passes with exact fusion, on 4 GPUs, in one call:
#  1. titan-verify (bitwise vs eager, CUDA graphs, kernels generated here) of a debug bf16
#     dp-shard 2 x tp 2 artifact (DEBUG=1), then of the 8B LAYOUTS (10 steps, deterministic kernels);
#  2. the side-by-side benchmark (MODES) of the 8B LAYOUTS at seq 8192.
# The 8B artifacts (default passes, and --fuse when MODES has titan-fuse) are built first, in
# the background, into one cache: the benchmark's own titan-build calls are then cache hits,
# and the verify runs fill the kernel store.
source "$(dirname "$0")/gpu_common.sh"
LAYOUTS=${LAYOUTS:-fsdp4 tp4}
MODES=${MODES:-eager,compile,titan,titan-fuse}
build_layouts "$(has_fuse)"
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
wait $builds; cat "$OUT/builds.txt"
timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/train_bench.py $(for l in $LAYOUTS; do echo --layout "$l"; done) \
  --steps 12 --modes "$MODES" --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
echo "== bench exit $? [$(elapsed) s]"
grep -h "^fusion:\|FAILED" "$OUT/bench.txt"
grep -v "^\[rank\|^W1\|^I1" "$OUT/bench.txt" | tail -10
