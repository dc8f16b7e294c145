#!/usr/bin/env bash
# GPU-host run, one call (issue 16): where titan-run's time to first step goes when the artifact
# carries its kernels, against torch.compile's warm-cache first step in the same run.
#   bash benchmarks/gpu/gpu_startup.sh        (one GPU; FLAVOR / SEQ_LEN override 1B / 2048)
#  1. titan-build --kernels (kernels compiled at build time, shipped in the artifact);
#  2. one rank under cProfile (torchrun-style environment, so the rank runs in this process):
#     the slowest start-up calls by cumulative time -> $OUT/startup-profile.txt;
#  3. train_bench rows compile, compile-warm, titan, titan-kernels: first step seconds side by side;
#  4. no noise (issue 30): the first run of the default flow (no kernels in the artifact, an empty
#     kernel store) and the profiled run print no warning or traceback text; the rank's imports.
source "$(dirname "$0")/gpu_common.sh"
FLAVOR=${FLAVOR:-1B}
SEQ_LEN=${SEQ_LEN:-2048}
export TITAN_KEY_FILE=$OUT/cache.key
install_titan
art=artifacts/startup-$FLAVOR
titan-build --flavor "$FLAVOR" --dtype bf16 --seq-len "$SEQ_LEN" --kernels --out "$art" > "$OUT/build.txt" 2>&1
echo "build --kernels: exit $? at $(elapsed) s; $(grep '^kernels:' "$OUT/build.txt")"
TITAN_CACHE_DIR=$OUT/empty-cache RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 \
  MASTER_PORT=29517 python benchmarks/profile_startup.py "$OUT/rank.prof" "$art" --steps 2 --device cuda \
  > "$OUT/profiled-run.txt" 2>&1
echo "profiled rank: exit $? at $(elapsed) s; $(grep -E '^(fusion|kernels):' "$OUT/profiled-run.txt" | head -2)"
grep '^profile_startup: imported' "$OUT/profiled-run.txt"
titan-build --flavor "$FLAVOR" --dtype bf16 --seq-len "$SEQ_LEN" --out "$art-default" > "$OUT/build-default.txt" 2>&1
TITAN_CACHE_DIR=$OUT/fresh-cache titan-run "$art-default" --steps 2 --device cuda > "$OUT/first-run.txt" 2>&1
echo "default flow, first run on an empty store: exit $? at $(elapsed) s"
for f in build.txt profiled-run.txt build-default.txt first-run.txt; do
  echo "noise in $f: $(grep -ciE 'warn|traceback|deprecat' "$OUT/$f") line(s)"; grep -iE 'warn|traceback|deprecat' "$OUT/$f" | head -3
done
python - "$OUT/rank.prof" > "$OUT/startup-profile.txt" <<'PY'
import pstats, sys
stats = pstats.Stats(sys.argv[1])
stats.sort_stats("cumulative").print_stats(45)
stats.sort_stats("tottime").print_stats(20)
PY
grep -E '^ +[0-9]' "$OUT/startup-profile.txt" | head -45
python -X importtime -c "import torch._inductor.standalone_compile" 2> "$OUT/importtime.txt"
echo "import torch._inductor (us, cumulative): $(grep -E 'torch\._inductor$' "$OUT/importtime.txt" | awk -F'|' '{print $2}')"
python benchmarks/train_bench.py --flavor "$FLAVOR" --seq-len "$SEQ_LEN" --layout single --steps 6 \
  --modes compile,compile-warm,titan,titan-kernels --json "$OUT/startup.json" > "$OUT/bench.txt" 2>&1
echo "bench: exit $? at $(elapsed) s"
grep -E 'first step|^single' "$OUT/bench.txt" | tail -12
