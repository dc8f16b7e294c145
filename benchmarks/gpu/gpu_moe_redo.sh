#!/usr/bin/env bash
# DeepSeek-V3's bounded MoE dispatch (titan-build --moe-capacity) with its overflow redo under
# CUDA graphs (issue 32; runtime/captured_redo.py), bf16, --deterministic:
#   bash benchmarks/gpu/gpu_moe_redo.sh        (nvidia-h100-x1; with 2 GPUs it adds the ep 2 rows)
#   FLAVORS=debug bash benchmarks/gpu/gpu_moe_redo.sh; FLAVORS=16B-4L TESTS=0 bash ...  (in two calls)
# For each of $FLAVORS (default: debug 16B-4L; SEQ_LEN, default 2048), each artifact NAME:
#  1. titan-build on this host ($OUT/build-NAME.txt; the dropless one first, whose programs the
#     bounded builds carry from the cache);
#  2. titan-verify --device cuda --deterministic, CUDA graphs on (the default): every step's loss
#     and every parameter bitwise against the dropless eager model, and how many steps were
#     redone ($OUT/verify-NAME.txt / .json);
#  3. titan-run with CUDA graphs and --metrics: median step time (the first two steps left out:
#     warm-up and capture), peak GPU memory, steps redone ($OUT/run-NAME.txt / .jsonl);
# then (unless TESTS=0) tests/gpu/test_captured_redo_cuda.py (the three graphs against the eager
# redo, micro-batch by micro-batch). A short table last.
# One GPU (world size 1, ep 1): every assignment goes to the one rank, so a capacity below 1
# overflows at every micro-batch (the redo's worst case: bounded forward + dropless step) and
# capacity 1 never does (the bounded path's own cost: the host read and the three graphs); the
# buffers cannot be smaller than the dropless ones without overflowing. With 2 GPUs, ep 2: a
# capacity that some steps pass and others do not, and 1.25, against the dropless buffers.
source "$(dirname "$0")/gpu_common.sh"
STEPS=${STEPS:-10}
SEQ_LEN=${SEQ_LEN:-2048}
FLAVORS=${FLAVORS:-debug 16B-4L}
install_titan
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
python3 -c "import torch; print('== torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"

ROWS=()
# artifact NAME FLAVOR EP CAPACITY(or dropless): build, verify, run; one table row.
artifact() {
  local name=$1 flavor=$2 ep=$3 cap=$4 art=artifacts/moe-redo-$1 shape capacity=() verified equal
  case $flavor in
    debug) shape=(--dtype bf16) ;;
    *) shape=(--seq-len "$SEQ_LEN" --batch-size 1) ;;
  esac
  [ "$cap" = dropless ] || capacity=(--moe-capacity "$cap")
  rm -rf "$art"
  titan-build --model deepseek_v3 --flavor "$flavor" --ep "$ep" "${shape[@]}" "${capacity[@]}" --out "$art" \
    > "$OUT/build-$name.txt" 2>&1
  echo "== built $name: exit $? [$(elapsed) s]"
  titan-verify "$art" --steps "$STEPS" --device cuda --deterministic --json "$OUT/verify-$name.json" \
    > "$OUT/verify-$name.txt" 2>&1
  verified=$?
  equal=$(grep -o 'bitwise equal: [a-z]*' "$OUT/verify-$name.txt" || echo "bitwise equal: n/a")
  echo "== verify $name: exit $verified, $equal [$(elapsed) s]"
  rm -f "$OUT/run-$name.jsonl"
  titan-run "$art" --steps "$STEPS" --device cuda --metrics "$OUT/run-$name.jsonl" \
    > "$OUT/run-$name.txt" 2>&1
  echo "== run $name: exit $? [$(elapsed) s]"
  ROWS+=("$(python3 - "$name" "$flavor" "$ep" "$cap" "$OUT" "$verified" "$equal" <<'EOF'
import json, re, statistics, sys
name, flavor, ep, cap, out, verified, equal = sys.argv[1:]
try:
    steps = [r for r in map(json.loads, open(f"{out}/run-{name}.jsonl")) if "step" in r]
except OSError:
    steps = []
times = [s["step_time_s"] for s in steps[2:]]  # step 1 warms up, step 2 captures
ms = f"{1000 * statistics.median(times):.1f}" if times else "n/a"
redone = sum(1 for s in steps if s.get("moe_redone"))
run = open(f"{out}/run-{name}.txt", errors="replace").read()
peak = re.search(r"peak GPU memory ([0-9.]+ GiB)", run)
build = open(f"{out}/build-{name}.txt", errors="replace").read()
saved = (re.search(r"memory: MoE capacity .*?saved activations ([0-9.]+ [GM]iB)", build)  # a bounded build's line
         or re.search(r"memory: .*?saved activations ([0-9.]+ [GM]iB)", build))
verdict = equal.split(": ")[-1] if verified == "0" else f"exit {verified}"
print(f"| {flavor} | {ep} | {cap} | {ms} | {peak.group(1) if peak else 'n/a'} | "
      f"{redone if cap != 'dropless' else '-'} of {len(steps)} | {saved.group(1) if saved else 'n/a'} | {verdict} |")
EOF
)")
}

for flavor in $FLAVORS; do
  artifact "$flavor-dropless" "$flavor" 1 dropless
  artifact "$flavor-cap1" "$flavor" 1 1.0
  artifact "$flavor-cap0.5" "$flavor" 1 0.5
done
if [ "$GPUS" -ge 2 ]; then
  for flavor in $FLAVORS; do
    artifact "$flavor-ep2-dropless" "$flavor" 2 dropless
    artifact "$flavor-ep2-cap1.25" "$flavor" 2 1.25
    artifact "$flavor-ep2-cap1.05" "$flavor" 2 1.05
  done
fi

tests="not run (TESTS=0)"
if [ "${TESTS:-1}" != 0 ]; then
  python3 -m pytest -q -m gpu tests/gpu/test_captured_redo_cuda.py > "$OUT/gpu-tests.txt" 2>&1
  tests=$(tail -1 "$OUT/gpu-tests.txt")
fi
echo "done at $(elapsed) s"
echo
echo "DeepSeek-V3 bounded MoE dispatch, overflow redo under CUDA graphs, --deterministic, $STEPS steps, $GPUS GPU(s)"
echo "| flavor | ep | capacity | median step (ms) | peak GPU memory (rank 0) | steps redone | saved activations (build) | titan-verify bitwise |"
echo "|---|---|---|---|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"
echo "GPU tests (tests/gpu/test_captured_redo_cuda.py): $tests"
