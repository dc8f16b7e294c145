#!/usr/bin/env bash
# Issue 32: device-side split sizes against titan's static dispatch buffers, on 2 GPUs (torch 2.11):
#   bash benchmarks/gpu/gpu_moe_splits.sh          (nvidia-h100-x2; ARGS="--tokens 4096" to change shapes)
# A DeepSeek-like token dispatch + combine (16B-like: 8192 tokens x 2048 bf16 per rank, 64 experts
# top-6, identity experts), timed as torchtitan's host-read splits, titan's static blocks
# (dropless worst case and capacity 1.25) and torch's NVSHMEM all_to_all_vdev (device splits):
# ms per dispatch + combine, eager and replayed from a CUDA graph where it captures, host syncs,
# rows moved. One table ($OUT/moe-splits.txt); a way that cannot run says why in its row.
source "$(dirname "$0")/gpu_common.sh"
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$GPUS" -lt 2 ]; then
  echo "skip: gpu_moe_splits.sh needs 2 CUDA GPUs, this host has $GPUS"
  exit 0
fi
python3 -c "import torch, torch.distributed._symmetric_memory as s; print('== torch', torch.__version__, \
'nvshmem available:', s.is_nvshmem_available())"
timeout 300 torchrun --standalone --nproc-per-node 2 benchmarks/moe_splits.py ${ARGS:-} 2>&1 | tee "$OUT/moe-splits.txt"
echo "== exit ${PIPESTATUS[0]} [$(elapsed) s]"
