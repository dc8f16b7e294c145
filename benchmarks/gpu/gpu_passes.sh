#!/usr/bin/env bash
# GPU-host checks for the compiler passes, in one call on 4 GPUs:
#  1. titan-verify (bitwise vs eager, CUDA graphs) on debug layouts with the default passes;
#  2. titan-verify on 8B dp-shard=4 and tp=4 (seq 8192, bf16, deterministic kernels);
#  3. the side-by-side benchmark with the pass ablation rows (fsdp4, tp4);
#  4. peak memory of 8B dp-shard=4 at batch 4 with --ac none / selective / full.
# The 8B artifacts are built first, in the background, into one build cache, so that the
# benchmark's own titan-build calls are cache hits. Logs and results go under ${OUT:-/tmp/titan-gpu}.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/titan-gpu}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TITAN_CACHE_DIR="$OUT/cache" TORCHINDUCTOR_CACHE_DIR="$OUT/inductor"
summary=()
note() { summary+=("$1"); echo "== $1"; }
t_start=$(date +%s)
elapsed() { echo $(( $(date +%s) - t_start )); }

build8b() {  # name, flags...
  local name=$1; shift
  titan-build --model llama3 --dtype bf16 --jobs 4 --out "artifacts/$name" "$@" > "$OUT/build-$name.txt" 2>&1
  echo "built $name: exit $? at $(elapsed) s"
}
(
  build8b fsdp4 --dp-shard 4 &
  build8b tp4 --tp 4 &
  build8b fsdp4-nopass --dp-shard 4 --passes mask_index_put_to_where &
  build8b tp4-nopass --tp 4 --passes mask_index_put_to_where &
  wait
  build8b fsdp4-bucket --dp-shard 4 --passes mask_index_put_to_where,bucket_all_gather,bucket_reduce_scatter &
  build8b fsdp4-overlap --dp-shard 4 --passes mask_index_put_to_where,overlap_collectives &
  build8b tp4-overlap --tp 4 --passes mask_index_put_to_where,overlap_collectives &
  wait
  for ac in none selective full; do build8b "fsdp4-b4-ac$ac" --dp-shard 4 --batch-size 4 --ac "$ac" & done
  wait
) > "$OUT/builds.txt" 2>&1 &
builds=$!

for layout in "--dp-shard 4" "--tp 4" "--dp-shard 2 --tp 2" "--dp-shard 4 --ac full"; do
  name=debug$(echo "$layout" | tr -d ' -')
  titan-build --flavor debug --dtype bf16 $layout --out "artifacts/$name" > /dev/null 2>&1
  timeout 120 titan-verify "artifacts/$name" --steps 10 --device cuda > "$OUT/verify-$name.txt" 2>&1
  note "verify debug bf16 $layout (default kernels, CUDA graphs): $(tail -1 "$OUT/verify-$name.txt") [$(elapsed) s]"
done

wait_for() { until grep -q "built $1:" "$OUT/builds.txt" 2>/dev/null; do sleep 2; done; grep "built $1:" "$OUT/builds.txt"; }
wait_for fsdp4
timeout 200 titan-verify artifacts/fsdp4 --steps 10 --deterministic > "$OUT/verify-8b-fsdp4.txt" 2>&1
note "verify 8B dp-shard4 default passes --deterministic: $(tail -1 "$OUT/verify-8b-fsdp4.txt") [$(elapsed) s]"

wait_for fsdp4-overlap
timeout 330 python3 benchmarks/train_bench.py --layout fsdp4 --layout tp4 --steps 12 \
  --modes eager,compile,titan-nopass,titan-bucket,titan-overlap,titan --json "$OUT/bench.json" 2>&1 \
  | tee "$OUT/bench.txt" | grep -v "^\[rank" | tail -16
note "bench done [$(elapsed) s]"

for ac in none selective full; do
  wait_for "fsdp4-b4-ac$ac" > /dev/null
  grep "rank 0:" "$OUT/build-fsdp4-b4-ac$ac.txt" | head -1
  timeout 90 titan-run "artifacts/fsdp4-b4-ac$ac" --steps 4 --metrics "$OUT/ac$ac.jsonl" > "$OUT/run-ac$ac.txt" 2>&1
  code=$?
  note "8B dp-shard4 batch4 --ac $ac: exit $code, $(tail -1 "$OUT/ac$ac.jsonl" 2>/dev/null || grep -m1 -i 'out of memory' "$OUT/run-ac$ac.txt" | cut -c1-160) [$(elapsed) s]"
done
wait $builds
printf '%s\n' "${summary[@]}"
