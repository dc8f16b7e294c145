#!/usr/bin/env bash
# GPU-host check (3 or more GPUs): FSDP shards that dp_shard does not divide are padded, as FSDP2
# pads them, and train bit for bit like eager with the same sharding on every rank.
#  1. titan-verify (losses per step and every parameter after the last step, bit for bit; CUDA
#     graphs, kernels generated here) of debug bf16 dp-shard 3: no dim-0 of the model divides by 3.
#  2. The same for 1B bf16 dp-shard 3 (ONE_B=0 skips it): model width 2048 and the feed-forward
#     rows 8192 do not divide by 3.
source "$(dirname "$0")/gpu_common.sh"
titan-build --flavor debug --dtype bf16 --dp-shard 3 --out artifacts/debug-dps3 > "$OUT/build-debug-dps3.txt" 2>&1
echo "== build debug dp-shard 3: exit $? [$(elapsed) s]"
timeout 200 titan-verify artifacts/debug-dps3 --steps 10 --device cuda > "$OUT/verify-debug-dps3.txt" 2>&1
echo "== verify debug bf16 dp-shard 3: $(tail -n 2 "$OUT/verify-debug-dps3.txt" | tr '\n' ' ') [$(elapsed) s]"
if [ "${ONE_B:-1}" = 1 ]; then
  titan-build --flavor 1B --dtype bf16 --dp-shard 3 --seq-len "${SEQ_LEN:-2048}" --jobs 3 --out artifacts/1b-dps3 \
    > "$OUT/build-1b-dps3.txt" 2>&1
  echo "== build 1B dp-shard 3: exit $? [$(elapsed) s]"
  timeout 300 titan-verify artifacts/1b-dps3 --steps 10 --deterministic > "$OUT/verify-1b-dps3.txt" 2>&1
  echo "== verify 1B bf16 dp-shard 3: $(tail -n 2 "$OUT/verify-1b-dps3.txt" | tr '\n' ' ') [$(elapsed) s]"
fi
