#!/usr/bin/env bash
# One-off device call (not committed): the captured update's GPU tests, then 1B seq 8192 verify with the full recipe.
source benchmarks/gpu/gpu_common.sh
install_titan
timeout 150 python3 -m pytest -q tests/gpu/test_gpu.py -k "captured_update or recipe_in_cuda_graphs" 2>&1 | tail -4
echo "== gpu tests [$(elapsed) s]"
art=artifacts/recipe-1b
titan-build --flavor 1B --seq-len 8192 --batch-size 1 --dtype bf16 --jobs 8 --out "$art" > "$OUT/build.txt" 2>&1
echo "== built: exit $? [$(elapsed) s]"
python3 -c "import numpy; numpy.random.default_rng(0).integers(0, 65535, 100000, dtype=numpy.uint16).tofile('/tmp/val.bin')"
timeout 300 titan-verify "$art" --steps 6 --device cuda --deterministic --lr 3e-4 --warmup-steps 2 --decay-type cosine \
  --min-lr-factor 0.1 --max-norm 1.0 --accumulation-steps 2 --val-data /tmp/val.bin --val-every 3 --val-steps 2 \
  > "$OUT/verify8k.txt" 2>&1
echo "== verify seq 8192: exit $? [$(elapsed) s]"
grep -E "^ +[0-9]|validation|parameters|bitwise|done:|error" "$OUT/verify8k.txt" | tail -14
