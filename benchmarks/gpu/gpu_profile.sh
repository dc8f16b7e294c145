#!/usr/bin/env bash
# GPU-host run, one call: where the step time goes, per mode, for the 8B LAYOUTS on 4 GPUs.
#  1. While the 8B artifacts build (CPU), the one-kernel AdamW is checked and timed on GPU 0
#     (benchmarks/adamw_exact.py, skipped with ADAMW=0).
#  2. train_bench.py with BENCH_PROFILE: each row's rank 0 profiles its last two steps; the
#     summaries are merged into $OUT/profile.json and printed.
source "$(dirname "$0")/gpu_common.sh"
LAYOUTS=${LAYOUTS:-fsdp4}
MODES=${MODES:-eager,compile,titan,titan-fuse}
STEPS=${STEPS:-10}
build_layouts "$(has_fuse)"
if [ "${ADAMW:-1}" = 1 ]; then
  timeout 240 python3 benchmarks/adamw_exact.py --json "$OUT/adamw.json" > "$OUT/adamw.txt" 2>&1
  echo "== adamw exit $? [$(elapsed) s]"; grep -v "^W1\|^I1" "$OUT/adamw.txt" | tail -12
fi
wait $builds; cat "$OUT/builds.txt"
rm -rf /tmp/titan-prof
BENCH_PROFILE=/tmp/titan-prof timeout "${BENCH_TIMEOUT:-480}" python3 benchmarks/train_bench.py \
  $(for l in $LAYOUTS; do echo --layout "$l"; done) --steps "$STEPS" --modes "$MODES" --json "$OUT/bench.json" \
  > "$OUT/bench.txt" 2>&1
echo "== bench exit $? [$(elapsed) s]"
python3 - "$OUT/profile.json" <<'EOF'
import json, pathlib, sys
sys.path.insert(0, "benchmarks")
from profile_steps import table
merged = {p.name.removesuffix(".summary.json"): json.loads(p.read_text())
          for p in sorted(pathlib.Path("/tmp/titan-prof").glob("*.summary.json"))}
pathlib.Path(sys.argv[1]).write_text(json.dumps(merged, indent=1))
for label, s in merged.items():
    print(table(label, s))
EOF
grep -h "FAILED" "$OUT/bench.txt"
grep -v "^\[rank\|^W1\|^I1\|USDT\|^  \|^    \|per step" "$OUT/bench.txt" | tail -8
