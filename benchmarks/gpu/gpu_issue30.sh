#!/usr/bin/env bash
# GPU-host run, one call on one GPU (issue 30): start-up and steady state against every peer row,
# the independent plain Llama (benchmarks/plain_llama.py) among them; the tables print last.
#   bash benchmarks/gpu/gpu_issue30.sh        (one H100, about 9 minutes; carry .whl for the tt rows)
# Overrides: VERIFY=1 STEADY_SEQS="8192 2048" MODES=... LATER_MODES=... STEPS=12 MAX_NORM=1.0 STARTUP_SEQ=2048 STARTUP_STEPS=6 REPEAT=1
#            BUDGET=540 (seconds: each phase is stopped so that the call ends by then)
#  1. titan (editable) and the pinned peer wheels, as gpu_peers.sh;
#  2. in the background, the 1B artifacts into the call's build cache: seq STARTUP_SEQ with and
#     without --kernels (start-up), the default passes and --fuse at each steady-state seq
#     (train_bench's own builds are then cache hits);
#  3. steady state at the first of STEADY_SEQS, rows without an artifact first while the builds
#     run (train_bench.py, BENCH_PROFILE: each row's last two steps profiled, out of the medians;
#     every row clips at --max-norm MAX_NORM, default 1.0 as train_bench's; 0: no row clips);
#  4. titan-verify --deterministic of the default artifact at STARTUP_SEQ, 3 steps (bitwise, its
#     exact regions compiled on this GPU; VERIFY=0 skips it);
#  5. start-up, once the builds are done and nothing else runs (benchmarks/startup_table.py):
#     plain eager, plain per-block compile cold and warm, titan from the --kernels artifact on an
#     empty cache, the default flow's first run on an empty cache, and its second run;
#  6. steady state at the other seqs;
#  7. the tables (benchmarks/issue30_report.py): where each row's time goes with the matmuls'
#     TFLOP/s against the measured peak; steady state with x best peer and the targets;
#     start-up with its targets and each row's warning/traceback line count (the no-noise check).
# Raw: $OUT/steady-SEQ.json, $OUT/profile-SEQ/, $OUT/startup.json; logs $OUT/*.txt, $OUT/startup-logs/.
source "$(dirname "$0")/gpu_common.sh"
FLAVOR=${FLAVOR:-1B}
STEADY_SEQS=${STEADY_SEQS:-8192 2048}
# While the builds run (the first minute): the slowest-starting peer and eager rows first, so
# that the contenders' timed steps come after the builds (less CPU contention).
MODES=${MODES:-tt-toolkit,plain-eager,ref-compile,plain-compile,tt-compile,titan,titan-fuse}
# After the first seq the builds are done: the rows the targets name first, in case time runs out.
LATER_MODES=${LATER_MODES:-titan,titan-fuse,plain-compile,tt-compile,ref-compile,tt-toolkit,plain-eager}
STEPS=${STEPS:-12}
STARTUP_SEQ=${STARTUP_SEQ:-2048}
BUDGET=${BUDGET:-540}
export BENCH_ROW_TIMEOUT=${BENCH_ROW_TIMEOUT:-150} TITAN_KEY_FILE=$OUT/cache.key
left() { echo $(( BUDGET - $(elapsed) )); }
at_most() { local n=$(( $(left) - $2 )); [ "$n" -gt "$1" ] && n=$1; [ "$n" -lt 10 ] && n=10; echo "$n"; }

install_titan
if python3 -m pip install -q --no-index --find-links .whl --no-deps --no-compile --no-cache-dir --require-hashes \
     -r benchmarks/peer_wheels.txt --target /tmp/peer-site > "$OUT/peer-install.txt" 2>&1; then
  export PYTHONPATH=/tmp/peer-site${PYTHONPATH:+:$PYTHONPATH}
else
  echo "== peer wheels NOT installed (carry .whl; see $OUT/peer-install.txt): the tt rows will say why"
fi
site=$(python3 -c "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))")
echo "== torch $(python3 -c 'import torch; print(torch.__version__)'), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1);" \
  "site-packages $([ -w "$site" ] && echo writable || echo read-only) [$(elapsed) s]"

build() {  # NAME SEQ FLAGS...: the flags train_bench.py builds with, so that its builds hit this cache
  local name=$1 seq=$2; shift 2
  titan-build --flavor "$FLAVOR" --seq-len "$seq" --batch-size 1 --dtype bf16 --out "artifacts/i30-$name" "$@" \
    > "$OUT/build-$name.txt" 2>&1
  echo "built $name: exit $? at $(elapsed) s $(grep -m1 '^kernels:' "$OUT/build-$name.txt")"
}
rm -rf artifacts/i30-*
(
  build "kernels-$STARTUP_SEQ" "$STARTUP_SEQ" --kernels &
  build "default-$STARTUP_SEQ" "$STARTUP_SEQ" &
  for seq in $STEADY_SEQS; do
    [ "$seq" = "$STARTUP_SEQ" ] || build "default-$seq" "$seq" &
    build "fuse-$seq" "$seq" --fuse &
  done
  wait
) > "$OUT/builds.txt" 2>&1 &
builds=$!

steady() {  # SEQ LIMIT MODES: train_bench over MODES, profiled, stopped after LIMIT s
  rm -rf "$OUT/profile-$1" "$OUT/steady-$1.json"
  BENCH_PROFILE=$OUT/profile-$1 timeout "$2" python3 benchmarks/train_bench.py --flavor "$FLAVOR" --seq-len "$1" \
    --batch-size 1 --layout single --steps "$STEPS" --max-norm "${MAX_NORM:-1.0}" --modes "$3" --json "$OUT/steady-$1.json" \
    > "$OUT/steady-$1.txt" 2>&1
  echo "== steady state seq $1: exit $? [$(elapsed) s]"
  grep -E "^single .*(FAILED|tok/s)" "$OUT/steady-$1.txt" | cut -c1-120
}
set -- $STEADY_SEQS
first_seq=$1; shift
steady "$first_seq" "$(at_most 260 190)" "$MODES"

# The builds, but not past the time the rest needs (a missing artifact fails its rows, and says so).
while kill -0 $builds 2>/dev/null && [ "$(left)" -gt 200 ]; do sleep 2; done
cat "$OUT/builds.txt"; rm -f "$OUT/startup.json"
# The default artifact against eager, bit for bit (its exact regions compiled here); VERIFY=0 skips.
if [ "${VERIFY:-1}" = 1 ]; then
  timeout "$(at_most 150 190)" titan-verify "artifacts/i30-default-$STARTUP_SEQ" --steps 3 --device cuda --deterministic \
    --max-norm "${MAX_NORM:-1.0}" > "$OUT/verify.txt" 2>&1
  echo "== titan-verify --deterministic, 1B seq $STARTUP_SEQ, 3 steps: exit $? [$(elapsed) s]"; tail -4 "$OUT/verify.txt" | cut -c1-160
fi
timeout "$(at_most 170 40)" python3 benchmarks/startup_table.py --kernels-artifact "artifacts/i30-kernels-$STARTUP_SEQ" \
  --artifact "artifacts/i30-default-$STARTUP_SEQ" --flavor "$FLAVOR" --seq-len "$STARTUP_SEQ" \
  --steps "${STARTUP_STEPS:-6}" --repeat "${REPEAT:-1}" --timeout 100 --json "$OUT/startup.json" \
  --logs "$OUT/startup-logs" > "$OUT/startup.txt" 2>&1
echo "== start-up: exit $? [$(elapsed) s]"; grep -E "^(plain|titan)-[a-z-]+: " "$OUT/startup.txt" | cut -c1-120

for seq in "$@"; do steady "$seq" "$(at_most 240 12)" "$LATER_MODES"; done

report=()
for seq in $STEADY_SEQS; do report+=(--steady "$seq=$OUT/steady-$seq.json" --profile "$seq=$OUT/profile-$seq"); done
python3 benchmarks/issue30_report.py "${report[@]}" --startup "$OUT/startup.json"
echo "== done [$(elapsed) s]"
