#!/usr/bin/env bash
# GPU-host runs for the exact fusion (fuse_exact, in the default passes), on 4 GPUs.
#   PHASE=check: titan-verify (bitwise vs eager, CUDA graphs) of debug bf16 layouts and of 8B
#     tp=4 and dp-shard=4 (deterministic kernels), which also fills the kernel store; the 8B
#     builds the benchmark uses are made meanwhile. The build cache with the kernel store is
#     packed into $OUT/cache.tgz for the next phase.
#   PHASE=bench: unpacks CACHE_TGZ if given, then the side-by-side benchmark (MODES).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/titan-gpu}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TITAN_CACHE_DIR=${TITAN_CACHE_DIR:-/tmp/titan-cache}
mkdir -p "$TITAN_CACHE_DIR"
t_start=$(date +%s)
elapsed() { echo $(( $(date +%s) - t_start )); }
build8b() {
  local name=$1; shift
  titan-build --model llama3 --dtype bf16 --jobs 4 --out "artifacts/$name" "$@" > "$OUT/build-$name.txt" 2>&1
  echo "built $name: exit $? at $(elapsed) s"
}
wait_for() { until grep -q "built $1:" "$OUT/builds.txt" 2>/dev/null; do sleep 2; done; }

if [ "${PHASE:-check}" = check ]; then
  (
    build8b tp4 --tp 4 & build8b fsdp4 --dp-shard 4 & wait
    build8b tp4-noexact --tp 4 --passes mask_index_put_to_where,overlap_collectives &
    build8b fsdp4-noexact --dp-shard 4 \
      --passes mask_index_put_to_where,bucket_all_gather,bucket_reduce_scatter,overlap_collectives & wait
    build8b tp4-fuse --tp 4 --fuse & build8b fsdp4-fuse --dp-shard 4 --fuse & wait
  ) > "$OUT/builds.txt" 2>&1 &
  builds=$!
  for layout in "--dp-shard 4" "--tp 4" "--dp-shard 2 --tp 2" "--dp-shard 4 --ac full"; do
    name=debug$(echo "$layout" | tr -d ' -')
    titan-build --flavor debug --dtype bf16 $layout --out "artifacts/$name" > /dev/null 2>&1
    timeout 150 titan-verify "artifacts/$name" --steps 10 --device cuda > "$OUT/verify-$name.txt" 2>&1
    echo "== verify debug bf16 $layout: $(grep -m1 '^fusion:' "$OUT/verify-$name.txt") | $(tail -1 "$OUT/verify-$name.txt") [$(elapsed) s]"
  done
  for name in tp4 fsdp4; do
    wait_for $name
    timeout 200 titan-verify artifacts/$name --steps 10 --deterministic > "$OUT/verify-8b-$name.txt" 2>&1
    echo "== verify 8B $name default passes --deterministic: $(grep -m1 '^fusion:' "$OUT/verify-8b-$name.txt") | $(tail -1 "$OUT/verify-8b-$name.txt") [$(elapsed) s]"
  done
  wait $builds; cat "$OUT/builds.txt"
  du -sh "$TITAN_CACHE_DIR" "$TITAN_CACHE_DIR"/kernels 2>/dev/null
  tar czf "$OUT/cache.tgz" -C "$TITAN_CACHE_DIR" . && ls -la "$OUT/cache.tgz"
else
  [ -n "${CACHE_TGZ:-}" ] && tar xzf "$CACHE_TGZ" -C "$TITAN_CACHE_DIR"
  timeout ${BENCH_TIMEOUT:-540} python3 benchmarks/train_bench.py --layout fsdp4 --layout tp4 --steps 12 \
    --modes "${MODES:-eager,compile,titan-noexact,titan,titan-fuse}" --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
  echo "== bench exit $? [$(elapsed) s]"
  grep -h "^fusion:" "$OUT/bench.txt" | sort | uniq -c | head -6
  grep -v "^\[rank\|^W1\|^I1" "$OUT/bench.txt" | tail -16
fi
