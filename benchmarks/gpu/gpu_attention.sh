#!/usr/bin/env bash
# GPU-host run, one call, one GPU (nvidia-h100-x1): cuDNN attention in titan::attention.
#  1. The GPU test that checks cuDNN's values and layouts against flash-attention 2's; the kernel
#     titan::attention picks for Llama-3 1B's shapes, timed against flash-attention 2.
#  2. titan-verify (losses and parameters bit for bit against eager, 3 steps) of a debug bf16
#     and a 1B bf16 seq 2048 single-rank artifact, each with and without --deterministic (which
#     selects flash-attention 2); a table of the four results last.
source "$(dirname "$0")/gpu_common.sh"
if ! python3 -c "import titan.cli.build" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/titan-install.txt" 2>&1
  echo "== titan installed: exit $? [$(elapsed) s]"
fi
titan-build --flavor 1B --seq-len 2048 --dtype bf16 --jobs 8 --out artifacts/attn-1b > "$OUT/build-1b.txt" 2>&1 &
build1b=$!
titan-build --flavor debug --dtype bf16 --out artifacts/attn-debug > "$OUT/build-debug.txt" 2>&1
echo "== built debug: exit $? [$(elapsed) s]"
timeout 120 python3 -m pytest -q tests/gpu/test_gpu.py -k "cudnn_attention or attention_op" > "$OUT/gpu-test.txt" 2>&1
echo "== GPU attention tests: $(tail -n 1 "$OUT/gpu-test.txt") [$(elapsed) s]"
grep -E "^(FAILED|E )" "$OUT/gpu-test.txt" | head -20
timeout 120 python3 benchmarks/attention_kernels.py 2>&1 | tail -n 4
wait $build1b; echo "== built 1B: exit $? [$(elapsed) s]"
rows=()
for art in debug 1b; do
  for det in "" --deterministic; do
    name="$art${det:+-det}"
    timeout 240 titan-verify "artifacts/attn-$art" --steps 3 --device cuda $det --json "$OUT/verify-$name.json" \
      > "$OUT/verify-$name.txt" 2>&1
    rc=$?
    bitwise=$(python3 -c "import json,sys; print('yes' if json.load(open(sys.argv[1]))['bitwise_equal'] else 'no')" \
      "$OUT/verify-$name.json" 2>/dev/null || echo "error (exit $rc)")
    echo "== verify $name: exit $rc | $(tail -n 2 "$OUT/verify-$name.txt" | tr '\n' ' ') [$(elapsed) s]"
    rows+=("$(printf '%-8s %-15s %s' "$art" "${det:-default}" "$bitwise")")
  done
done
echo; printf '%-8s %-15s %s\n' artifact mode bitwise; printf '%s\n' "${rows[@]}"
