#!/usr/bin/env bash
# GPU-host checks for --fuse and the default passes on 4 GPUs, in one call: titan-verify of 8B
# tp=4 (default passes, deterministic kernels), then the side-by-side benchmark with the
# default passes, --fuse, and no CUDA graphs. Artifacts are built first, in the background,
# into one cache, so that the benchmark's titan-build calls are cache hits.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/titan-gpu}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TITAN_CACHE_DIR="$OUT/cache"
t_start=$(date +%s)
elapsed() { echo $(( $(date +%s) - t_start )); }
build8b() {
  local name=$1; shift
  titan-build --model llama3 --dtype bf16 --jobs 4 --out "artifacts/$name" "$@" > "$OUT/build-$name.txt" 2>&1
  echo "built $name: exit $? at $(elapsed) s"
}
MODES=${MODES:-eager,compile,titan,titan-fuse,titan-nocg}
(
  build8b fsdp4 --dp-shard 4 & build8b tp4 --tp 4 & build8b fsdp4-fuse --dp-shard 4 --fuse &
  build8b tp4-fuse --tp 4 --fuse &
  build8b fsdp4-fuse-blocks --dp-shard 4 --fuse blocks & build8b tp4-fuse-blocks --tp 4 --fuse blocks & wait
) > "$OUT/builds.txt" 2>&1 &
builds=$!
wait_for() { until grep -q "built $1:" "$OUT/builds.txt" 2>/dev/null; do sleep 2; done; }
if [ "${VERIFY:-1}" = 1 ]; then
  wait_for tp4
  timeout 200 titan-verify artifacts/tp4 --steps 10 --deterministic > "$OUT/verify-8b-tp4.txt" 2>&1
  echo "== verify 8B tp4 default passes --deterministic: $(tail -1 "$OUT/verify-8b-tp4.txt") [$(elapsed) s]"
fi
wait $builds; cat "$OUT/builds.txt"
timeout 420 python3 benchmarks/train_bench.py --layout fsdp4 --layout tp4 --steps 12 \
  --modes "$MODES" --json "$OUT/bench-fuse.json" > "$OUT/bench-fuse.txt" 2>&1
echo "== bench exit $? [$(elapsed) s]"
grep -h "^fusion:" "$OUT"/bench-fuse.txt | head -4
grep -v "^\[rank\|^W1\|^I1" "$OUT/bench-fuse.txt" | tail -16
