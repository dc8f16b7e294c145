#!/usr/bin/env bash
# The training recipe on one GPU (issue 27):
#   bash benchmarks/gpu/gpu_recipe.sh           (nvidia-h100-x1 or nvidia-h200; no internet needed)
# Llama-3 1B, batch 1, bf16:
#  1. at seq $VERIFY_SEQ (2048: at 8192 the eager reference and the artifact's program do not
#     fit one 80 GiB GPU together), titan-verify --device cuda --deterministic, CUDA graphs on
#     (the step and the optimizer update), with the full recipe (warmup +
#     cosine decay + clipping at 1.0 + 2-way accumulation): every step's loss and grad norm and
#     every parameter bitwise against eager (LambdaLR, clip_grad_norm_, autograd accumulation),
#     and the validation loss of 2 held-out batches every 3 steps;
#  2. at seq 8192, titan-run, CUDA graphs: median step time without recipe options and with warmup + cosine +
#     clipping (one micro-batch each, so the steps do the same forward/backward work);
#  3. the clip alone over the 1B gradients (benchmarks/clip_cost.py).
# A short table last.
source "$(dirname "$0")/gpu_common.sh"
STEPS=${STEPS:-6}
install_titan
python3 -c "import torch; print('== torch', torch.__version__, torch.cuda.get_device_name(0))"
VERIFY_SEQ=${VERIFY_SEQ:-2048}
art=artifacts/recipe-1b
titan-build --flavor 1B --seq-len 8192 --batch-size 1 --dtype bf16 --jobs 8 --out "$art" > "$OUT/build.txt" 2>&1
echo "== built: exit $? [$(elapsed) s]"
vart=artifacts/recipe-1b-$VERIFY_SEQ
titan-build --flavor 1B --seq-len "$VERIFY_SEQ" --batch-size 1 --dtype bf16 --jobs 8 --out "$vart" > "$OUT/build-v.txt" 2>&1
echo "== built seq $VERIFY_SEQ: exit $? [$(elapsed) s]"
RECIPE=(--lr 3e-4 --warmup-steps 2 --decay-type cosine --min-lr-factor 0.1 --max-norm 1.0)
python3 -c "import numpy; numpy.random.default_rng(0).integers(0, 65535, 100000, dtype=numpy.uint16).tofile('/tmp/val.bin')"
titan-verify "$vart" --steps "$STEPS" --device cuda --deterministic "${RECIPE[@]}" --accumulation-steps 2 \
  --val-data /tmp/val.bin --val-every 3 --val-steps 2 --json "$OUT/verify.json" > "$OUT/verify.txt" 2>&1
echo "== verify: exit $? [$(elapsed) s]"
tail -14 "$OUT/verify.txt"
median() {
  python3 - "$1" <<'PY'
import json, statistics, sys
recs = [r for r in map(json.loads, open(sys.argv[1])) if "step" in r]
t = [r["step_time_s"] for r in recs[2:]]  # the first steps warm up and capture
print(f"{1000 * statistics.median(t):.1f} ms/step, grad_norm {recs[-1].get('grad_norm', float('nan')):.4f}, lr {recs[-1]['lr']:.3g}")
PY
}
for mode in plain recipe plain2 recipe2; do
  rm -f "$OUT/run-$mode.jsonl"
  extra=(); case $mode in recipe*) extra=("${RECIPE[@]}");; esac
  titan-run "$art" --steps 30 --device cuda --metrics "$OUT/run-$mode.jsonl" "${extra[@]}" > "$OUT/run-$mode.txt" 2>&1
  echo "== run $mode: exit $? [$(elapsed) s]: $(median "$OUT/run-$mode.jsonl")"
done
python3 benchmarks/clip_cost.py "$art" 2>&1 | tee "$OUT/clip.txt"
echo "| what | result |"
echo "|---|---|"
echo "| verify 1B seq $VERIFY_SEQ, full recipe, CUDA graphs, --deterministic | $(grep -o 'bitwise equal: [a-z]*' "$OUT/verify.txt") |"
for mode in plain recipe plain2 recipe2; do echo "| titan-run $mode | $(median "$OUT/run-$mode.jsonl") |"; done
echo "| clip alone | $(cat "$OUT/clip.txt") |"
