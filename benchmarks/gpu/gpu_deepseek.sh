#!/usr/bin/env bash
# DeepSeek-V3 on one GPU (issue 19), world size 1, no expert parallelism, bf16:
#   bash benchmarks/gpu/gpu_deepseek.sh           (nvidia-h100-x1 or nvidia-h200; no internet needed)
# For each of debug and 16B-4L (16B's published widths, first 4 of its 27 layers; SEQ_LEN,
# default 2048):
#  1. titan-build on this host (CPU work; $OUT/build-NAME.txt, its memory line in the table);
#  2. titan-verify --device cuda --deterministic, CUDA graphs on (the default): the captured
#     step, MoE dispatch included, against the eager reference, every step's loss and every
#     parameter after the last step bitwise ($OUT/verify-NAME.txt / .json);
#  3. titan-run with CUDA graphs and --metrics: median step time and the last step's expert
#     load (max / mean tokens per expert, dropped tokens) ($OUT/run-NAME.txt / .jsonl);
# then the model's GPU tests (tests/gpu/test_deepseek_v3_cuda_graph.py: capture + replay == eager).
# A short table last.
source "$(dirname "$0")/gpu_common.sh"
STEPS=${STEPS:-10}
SEQ_LEN=${SEQ_LEN:-2048}
install_titan
python3 -c "import torch; print('== torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"

declare -A ROW
for name in debug 16B-4L; do
  case $name in
    debug) shape=(--dtype bf16) ;;
    *) shape=(--seq-len "$SEQ_LEN" --batch-size 1) ;;
  esac
  art=artifacts/deepseek-gpu-$name
  rm -rf "$art"
  titan-build --model deepseek_v3 --flavor "$name" "${shape[@]}" --out "$art" > "$OUT/build-$name.txt" 2>&1
  built=$?
  echo "== built $name: exit $built [$(elapsed) s]"
  memory=$(grep -o 'memory: .*' "$OUT/build-$name.txt" | head -1)
  titan-verify "$art" --steps "$STEPS" --device cuda --deterministic --json "$OUT/verify-$name.json" \
    > "$OUT/verify-$name.txt" 2>&1
  verified=$?
  echo "== verify $name: exit $verified [$(elapsed) s]"
  tail -4 "$OUT/verify-$name.txt"
  rm -f "$OUT/run-$name.jsonl"
  titan-run "$art" --steps "$STEPS" --device cuda --metrics "$OUT/run-$name.jsonl" > "$OUT/run-$name.txt" 2>&1
  ran=$?
  echo "== run $name: exit $ran [$(elapsed) s]"
  run=$(python3 - "$OUT/run-$name.jsonl" <<'EOF'
import json, statistics, sys
try:
    steps = [r for r in map(json.loads, open(sys.argv[1])) if "step" in r]  # after the config header
except OSError:
    steps = []
if not steps:
    print("no steps")
else:
    last = steps[-1]
    times = [s["step_time_s"] for s in steps[1:]]  # the first step captures the graph
    ms = f"{1000 * statistics.median(times):.1f} ms/step" if times else "step time n/a"
    print(f"{ms}; last loss {last.get('loss', float('nan')):.4f}; expert load max {last.get('expert_load_max')} "
          f"mean {last.get('expert_load_mean')} dropped {last.get('dropped_tokens')}")
EOF
)
  equal=$(grep -o 'bitwise equal: [a-z]*' "$OUT/verify-$name.txt" || echo "bitwise equal: n/a")
  ROW[$name]="build $built | verify $verified ($equal) | run $ran: $run | $memory"
done

python3 -m pytest -q -m gpu tests/gpu/test_deepseek_v3_cuda_graph.py > "$OUT/gpu-tests.txt" 2>&1
tests=$(tail -1 "$OUT/gpu-tests.txt")
echo "done at $(elapsed) s"
echo
echo "DeepSeek-V3, one GPU, world size 1, --deterministic, CUDA graphs, $STEPS steps (exit codes: 0 = ok)"
for name in debug 16B-4L; do
  echo "$name | ${ROW[$name]}"
done
echo "GPU tests (tests/gpu/test_deepseek_v3_cuda_graph.py): $tests"
