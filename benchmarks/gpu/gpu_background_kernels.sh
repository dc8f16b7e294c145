#!/usr/bin/env bash
# GPU-host run (issue 30): the default flow's first run on a fresh host, its exact kernels
# compiled by worker processes while its first steps run on eager's kernels
# (runtime/kernels/background.py), against a second run on the same kernel store (every kernel
# in from step 1): each step's loss and gradient norm must be equal, bit for bit. Both runs pass
# FLAGS (default --deterministic: without it cuDNN's attention backward and the embedding's
# backward accumulate in an order that varies from run to run, so no two runs are bitwise equal;
# CONTROL=N then shows that: two more runs of N steps without FLAGS, both with every kernel in).
#   bash benchmarks/gpu/gpu_background_kernels.sh      (one GPU, about 3 minutes)
# Overrides: FLAVOR=1B SEQ=2048 STEPS=300 FLAGS=--deterministic CONTROL=0 ART=a prebuilt default
# artifact of that shape (several GPUs: its ranks, one GPU each)
# Prints both runs' kernel lines, the step the kernels came in at, the median step time before
# and after, and the comparisons.
source "$(dirname "$0")/gpu_common.sh"
FLAVOR=${FLAVOR:-1B}
SEQ=${SEQ:-2048}
STEPS=${STEPS:-300}
FLAGS=${FLAGS---deterministic}
install_titan
art=${ART:-artifacts/background-$FLAVOR-$SEQ}
if [ -z "${ART:-}" ]; then
  titan-build --flavor "$FLAVOR" --seq-len "$SEQ" --batch-size 1 --dtype bf16 --out "$art" > "$OUT/build.txt" 2>&1
  echo "built $art: exit $? [$(elapsed) s]"
fi
cache=$OUT/cache-background
rm -rf "$cache"
run() {  # NAME STEPS FLAGS...: one run, with the most GPU memory in use on the host (every process) while it ran
  local name=$1 steps=$2 rc watch; shift 2
  rm -f "$OUT/$name.jsonl"
  (while sleep 1; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; done) > "$OUT/$name.mem" &
  watch=$!
  TITAN_CACHE_DIR=$cache timeout 300 titan-run "$art" --steps "$steps" --max-norm 1.0 --metrics "$OUT/$name.jsonl" \
    "$@" > "$OUT/$name.txt" 2>&1
  rc=$?
  kill $watch 2>/dev/null
  echo "== $name run ($*): exit $rc, GPU memory in use at most $(sort -n "$OUT/$name.mem" | tail -1) MiB [$(elapsed) s]"
  grep -E "^(kernels|fusion):|^done:" "$OUT/$name.txt" | cut -c1-400
}
run first "$STEPS" $FLAGS
run second "$STEPS" $FLAGS
python3 - "$OUT/first.jsonl" "$OUT/second.jsonl" "$OUT/first.txt" <<'PY'
import json, re, statistics, sys
runs = [[r for r in map(json.loads, open(path)) if "step" in r] for path in sys.argv[1:3]]
first, second = runs
m = re.search(r"in use from step (\d+), ([\d.]+) s after the start", open(sys.argv[3]).read())
switch = int(m[1]) if m else None
print(f"kernels in use from step {switch} ({m[2]} s after the start)" if m else "kernels never came in during the first run")
if switch:
    before = [r["step_time_s"] for r in first[1:switch - 1]]
    after = [r["step_time_s"] for r in first[switch + 1:]]
    if before and after:
        print(f"median step: {statistics.median(before) * 1e3:.1f} ms before (eager's kernels), "
              f"{statistics.median(after) * 1e3:.1f} ms after; second run {statistics.median(r['step_time_s'] for r in second[2:]) * 1e3:.1f} ms")
diff = [(a["step"], k) for a, b in zip(first, second) for k in ("loss", "grad_norm") if a.get(k) != b.get(k)]
print(f"steps compared: {min(len(first), len(second))}; differing values: {len(diff)}"
      + (f" (first at step {diff[0][0]}, {diff[0][1]})" if diff else " (bitwise equal)"))
PY
if [ "${CONTROL:-0}" -gt 0 ]; then
  run control-a "$CONTROL"
  run control-b "$CONTROL"
  python3 - "$OUT/control-a.jsonl" "$OUT/control-b.jsonl" <<'PY'
import json, sys
a, b = ([r for r in map(json.loads, open(path)) if "step" in r] for path in sys.argv[1:3])
diff = [(x["step"], k) for x, y in zip(a, b) for k in ("loss", "grad_norm") if x.get(k) != y.get(k)]
print(f"control (two runs without FLAGS, every kernel in from step 1): {len(diff)} differing values"
      + (f", first at step {diff[0][0]} ({diff[0][1]})" if diff else " (bitwise equal)"))
PY
fi
echo "== done [$(elapsed) s]"
