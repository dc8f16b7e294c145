#!/usr/bin/env bash
# GPU-host run, one call: the one-kernel AdamW and the default passes' numerics on 4 GPUs.
#  1. While the 8B artifacts of LAYOUTS build (default passes, and --fuse), the one-kernel AdamW
#     is checked op by op and over whole steps, and timed, on GPU 0 (benchmarks/adamw_exact.py).
#  2. titan-verify (losses per step and parameters after the last step, bit for bit; CUDA graphs,
#     kernels generated here) of a debug bf16 dp-shard 2 x tp 2 artifact (DEBUG=1), then of the
#     8B VERIFY layouts (default: LAYOUTS).
#  3. The GPU tests (TESTS=1; TESTS_K selects some by pytest -k). FUSE=0 skips the --fuse builds.
source "$(dirname "$0")/gpu_common.sh"
LAYOUTS=${LAYOUTS:-fsdp4 tp4}
VERIFY=${VERIFY:-$LAYOUTS}
build_layouts "${FUSE:-1}"
timeout 200 python3 benchmarks/adamw_exact.py --json "$OUT/adamw.json" > "$OUT/adamw.txt" 2>&1
echo "== adamw exit $? [$(elapsed) s]"; grep -v "^W1\|^I1" "$OUT/adamw.txt" | tail -24
if [ "${DEBUG:-1}" = 1 ]; then
  titan-build --flavor debug --dtype bf16 --dp-shard 2 --tp 2 --out artifacts/debug-dp2tp2 > /dev/null 2>&1
  timeout 150 titan-verify artifacts/debug-dp2tp2 --steps 10 --device cuda > "$OUT/verify-debug.txt" 2>&1
  echo "== verify debug bf16 dp2tp2: $(grep -m1 '^fusion:' "$OUT/verify-debug.txt") | $(tail -n 2 "$OUT/verify-debug.txt" | tr '\n' ' ') [$(elapsed) s]"
fi
wait $builds; cat "$OUT/builds.txt"
for l in $VERIFY; do
  timeout 220 titan-verify "artifacts/$l" --steps 10 --deterministic > "$OUT/verify-8b-$l.txt" 2>&1
  echo "== verify 8B $l: $(grep -m1 '^fusion:' "$OUT/verify-8b-$l.txt") | $(tail -n 2 "$OUT/verify-8b-$l.txt" | tr '\n' ' ') [$(elapsed) s]"
done
if [ "${TESTS:-1}" = 1 ]; then
  timeout 300 python3 -m pytest -q tests/gpu/test_gpu.py ${TESTS_K:+-k "$TESTS_K"} > "$OUT/gpu-tests.txt" 2>&1
  echo "== GPU tests: $(tail -n 1 "$OUT/gpu-tests.txt") [$(elapsed) s]"
fi
