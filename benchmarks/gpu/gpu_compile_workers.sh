#!/usr/bin/env bash
# GPU-host run (issue 30): a fresh host's first run of a default artifact (every exact region
# compiled at start) with its regions compiled one after another (TITAN_COMPILE_WORKERS=0) and by
# parallel worker processes (runtime/kernels/compile_workers.py), each on an empty cache, in turns.
#   bash benchmarks/gpu/gpu_compile_workers.sh      (one GPU, about 4 minutes)
# Overrides: FLAVOR=1B SEQ=2048 WORKERS="0 4 8" ROUNDS=2 STEPS=2
# (--no-compile-in-background: the run waits for its regions, as this A/B compares.)
# Prints per run the whole process's seconds and the fusion line; then the medians per setting.
source "$(dirname "$0")/gpu_common.sh"
FLAVOR=${FLAVOR:-1B}
SEQ=${SEQ:-2048}
install_titan
art=artifacts/workers-$FLAVOR-$SEQ
titan-build --flavor "$FLAVOR" --seq-len "$SEQ" --batch-size 1 --dtype bf16 --out "$art" > "$OUT/build.txt" 2>&1
echo "built $art: exit $? [$(elapsed) s]"
: > "$OUT/workers.tsv"
for round in $(seq "${ROUNDS:-2}"); do
  for w in ${WORKERS:-0 4 8}; do
    rm -rf "$OUT/cache-$w"
    start=$(date +%s.%N)
    TITAN_CACHE_DIR=$OUT/cache-$w TITAN_COMPILE_WORKERS=$w timeout 200 titan-run "$art" --steps "${STEPS:-2}" --no-compile-in-background \
      > "$OUT/run-$w-$round.txt" 2>&1
    rc=$?
    took=$(python3 -c "print(round($(date +%s.%N) - $start, 1))")
    fusion=$(grep -m1 '^fusion:' "$OUT/run-$w-$round.txt")
    printf '%s\t%s\t%s\n' "$w" "$took" "$(sed -E 's/.* in ([0-9.]+) s.*/\1/' <<< "$fusion")" >> "$OUT/workers.tsv"
    echo "round $round, workers $w: exit $rc, process $took s | ${fusion:0:200}"
  done
done
python3 - "$OUT/workers.tsv" <<'EOF'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    w, took, fusion = line.rstrip("\n").split("\t")
    try:
        run = (float(took), float(fusion))
        rows.setdefault(int(w), []).append(run)
    except ValueError:
        print(f"workers {w}: a run without a fusion line (see its log)")
print("workers  process s (median, runs)  regions s (median)")
for w, runs in sorted(rows.items()):
    print(f"{w:7d}  {statistics.median(t for t, _ in runs):8.1f} ({', '.join(f'{t:.1f}' for t, _ in runs)})"
          f"  {statistics.median(f for _, f in runs):8.1f}")
EOF
