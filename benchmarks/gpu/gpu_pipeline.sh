#!/bin/bash
# Pipeline artifacts (titan-build --pp) on the GPUs of one host, over NCCL (issue 28). For each
# case: the artifact built here (on the CPU), titan-verify --device cuda --deterministic against
# torch.distributed.pipelining on the same GPUs (every step's loss and gradient norm and every
# parameter on every rank, bitwise), then titan-run's median step and peak memory.
#   NGPU=2 bash benchmarks/gpu/gpu_pipeline.sh          # pp 2: 1f1b, gpipe, interleaved-1f1b, zbv
#   NGPU=4 bash benchmarks/gpu/gpu_pipeline.sh          # also pp 2 x tp 2, pp 2 x dp-shard 2, pp 4,
#                                                       # DeepSeek-V3 pp 2 x ep 2 (1f1b, zbv)
#   NGPU=8 bash benchmarks/gpu/gpu_pipeline.sh          # also pp 4 x tp 2, pp 8
#   NGPU=2 CASES="pp2-flexdoc pp2-flexdoc-zbv pp2-flexcausal" bash benchmarks/gpu/gpu_pipeline.sh
#                                                       # FlexAttention stages (issue 31): the document
#                                                       # mask on a token file of random documents
#                                                       # (boundaries elsewhere in every micro-batch)
#   NGPU=4 CASES="pp2-fsdp2 pp2-fsdp2-permb pp2-fsdp2-zbv pp2-fsdp2-ac pp2-fsdp2-ac-permb" bash benchmarks/gpu/gpu_pipeline.sh
#                                                       # dp-shard stages gathered once per step; the -permb
#                                                       # twins gather in every micro-batch (compare step
#                                                       # time and peak memory)
# CASES="name ..." runs those only. Each rank's whole step is one CUDA graph (runtime/captured_pipeline.py);
# the verify and the timing also run with --no-cuda-graphs (op by op) beside it. A case's fourth
# field is what its verify and runs add (the document cases' --data).
# Kernels (titan-build --kernels with --pp): pp2-kernels builds the artifact with its stages'
# kernels compiled on this GPU; pp2-offline-kernels verifies artifacts/offline-pp2, built on a
# host without a GPU and carried here (skipped when absent):
#   titan-build --flavor debug --n-layers 8 --dtype bf16 --pp 2 --microbatches 4 --kernels --gpu h100 \
#     --out artifacts/offline-pp2     # (--gpu h200 on an H200 host)
# Their verify runs from an empty cache with the artifact's kernels trusted: "kernels" shows
# rank 0's fusion line (N from the artifact, 0 compiled) and how many kernels any rank compiled
# and stored (store=0: every stage on every rank ran the artifact's kernels).
# MoE capacity with --pp (4 GPUs): ds-pp2-ep2-cap redoes each overflowing stage forward dropless
# (verified against the dropless model; runs op by op: the redo is a host decision inside the
# step), ds-pp2-ep2-drop drops and pads (verified with --moe-drop against torch dropping alike);
# their run-*.txt end with the redo summary.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh"
install_titan
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
DEBUG="--flavor debug --n-layers 8 --dtype bf16"
# FlexAttention's GPU kernels take a sequence that is a multiple of 128; documents of 16-300 tokens.
FLEX="$DEBUG --seq-len 512 --attention flex"
DOCS="$OUT/docs-debug.bin"
python3 benchmarks/gpu/flex_check.py documents "$DOCS" --vocab 2048 --eos 2047 --tokens 200000 --shortest 16 \
  --longest 300 > /dev/null
CASE_LIST=(
  "2|pp2-1f1b|$DEBUG --pp 2 --microbatches 4"
  "2|pp2-gpipe|$DEBUG --pp 2 --pp-schedule gpipe --microbatches 4"
  "2|pp2-interleaved|$DEBUG --pp 2 --pp-schedule interleaved-1f1b --microbatches 4"
  "2|pp2-zbv|$DEBUG --pp 2 --pp-schedule zbv --microbatches 4"
  "2|1b-pp2|--flavor 1B --seq-len 2048 --pp 2 --microbatches 8"
  "2|pp2-flexdoc|$FLEX --mask document --eos-id 2047 --pp 2 --microbatches 4|--data $DOCS"
  "2|pp2-flexdoc-zbv|$FLEX --mask document --eos-id 2047 --pp 2 --pp-schedule zbv --microbatches 4|--data $DOCS"
  "2|pp2-flexcausal|$FLEX --pp 2 --microbatches 4|--data $DOCS"
  "4|pp2-tp2-flexdoc|$FLEX --mask document --eos-id 2047 --pp 2 --tp 2 --microbatches 4|--data $DOCS"
  "4|pp2-tp2|$DEBUG --pp 2 --tp 2 --microbatches 4"
  "4|pp2-fsdp2|$DEBUG --pp 2 --dp-shard 2 --microbatches 4"
  "4|pp2-fsdp2-permb|$DEBUG --pp 2 --dp-shard 2 --microbatches 4|--no-pp-gather-per-step"
  "4|pp2-fsdp2-zbv|$DEBUG --pp 2 --dp-shard 2 --pp-schedule zbv --microbatches 4"
  "4|pp2-fsdp2-ac|$DEBUG --pp 2 --dp-shard 2 --microbatches 4 --ac full"
  "4|pp2-fsdp2-ac-permb|$DEBUG --pp 2 --dp-shard 2 --microbatches 4 --ac full|--no-pp-gather-per-step"
  "4|pp4-1f1b|$DEBUG --pp 4 --microbatches 8"
  "4|ds-pp2-ep2|--model deepseek_v3 --flavor debug --dtype bf16 --pp 2 --ep 2 --microbatches 4"
  "4|ds-pp2-ep2-cap|--model deepseek_v3 --flavor debug --dtype bf16 --pp 2 --ep 2 --microbatches 4 --moe-capacity 1.05"
  "4|ds-pp2-ep2-drop|--model deepseek_v3 --flavor debug --dtype bf16 --pp 2 --ep 2 --microbatches 4 --moe-capacity 0.5 --moe-drop"
  "4|ds-pp2-ep2-zbv|--model deepseek_v3 --flavor debug --n-layers 4 --dtype bf16 --pp 2 --ep 2 --pp-schedule zbv --microbatches 4"
  "2|pp2-kernels|$DEBUG --pp 2 --microbatches 4 --kernels"
  "2|pp2-offline-kernels|carried"
  "8|pp4-tp2|$DEBUG --pp 4 --tp 2 --microbatches 8"
  "8|pp8-1f1b|$DEBUG --pp 8 --microbatches 8"
)
printf '%-18s %-6s %-24s %-24s %-12s %-12s %s\n' case ranks "verify graph" "verify op-by-op" "step graph" "op-by-op" "peak memory" > "$OUT/pipeline.txt"
median_step() {  # the median step time of a metrics file, leaving out the first three steps
  python3 -c "import json,statistics,sys; r=[json.loads(l) for l in open(sys.argv[1])][1:]; print(f\"{statistics.median(x['step_time_s'] for x in r[2:])*1e3:.1f} ms\")" "$1" 2>/dev/null
}
for entry in "${CASE_LIST[@]}"; do
  IFS='|' read -r need name build run_flags <<< "$entry"
  [ "$need" -le "$NGPU" ] || continue
  case " ${CASES:-$name} " in *" $name "*) ;; *) continue;; esac
  art=artifacts/gpu-$name
  if [ "$build" = carried ]; then
    art=artifacts/offline-pp2
    [ -f "$art/manifest.json" ] || { echo "$name: no $art (build it without a GPU and carry it): skipped"; continue; }
  else
    titan-build $build --out "$art" --replace > "$OUT/build-$name.txt" 2>&1 || { echo "$name: build failed"; tail -3 "$OUT/build-$name.txt"; continue; }
  fi
  case $name in *kernels)
    empty=$OUT/empty-cache-$name; rm -rf "$empty"
    TITAN_CACHE_DIR=$empty timeout 300 titan-verify "$art" --steps 6 --device cuda --deterministic --max-norm 1.0 \
      --trust-unsigned-kernels > "$OUT/verify-$name.txt" 2>&1
    echo "$name: verify exit $? | $(grep -m1 -o '^bitwise equal: [a-z]*' "$OUT/verify-$name.txt") | $(grep -m1 '^kernels:' "$OUT/build-$name.txt" 2>/dev/null) | $(grep -m1 '^fusion:' "$OUT/verify-$name.txt") | store=$(find "$empty/kernels/kernels" -type f -name '*.json' 2>/dev/null | wc -l) kernels compiled and stored by the run"
    grep -q '^bitwise equal: yes' "$OUT/verify-$name.txt" || grep -iE 'error|differ' "$OUT/verify-$name.txt" | head -3
    continue;;
  esac
  verdict="-"; verdict_ops="-"
  extra=""; case $name in *-drop) extra=--moe-drop;; esac
  if [ "$name" != 1b-pp2 ]; then  # the 1B case is timed only (its eager reference is the same code at 1B)
    timeout 300 titan-verify "$art" $extra --steps 6 --device cuda --deterministic --max-norm 1.0 $run_flags > "$OUT/verify-$name.txt" 2>&1
    verdict="exit $? $(grep -m1 -o '^bitwise equal: [a-z]*' "$OUT/verify-$name.txt")"
    timeout 300 titan-verify "$art" $extra --steps 6 --device cuda --deterministic --max-norm 1.0 --no-cuda-graphs $run_flags > "$OUT/verify-ops-$name.txt" 2>&1
    verdict_ops="exit $? $(grep -m1 -o '^bitwise equal: [a-z]*' "$OUT/verify-ops-$name.txt")"
    grep -q '^bitwise equal' "$OUT/verify-$name.txt" || grep -iE 'error|differ' "$OUT/verify-$name.txt" | head -3
    grep -m1 '^flex kernels' "$OUT/verify-$name.txt"  # FlexAttention cases: where their kernels came from
  fi
  timeout 300 titan-run "$art" --steps 12 --device cuda --metrics "$OUT/run-$name.jsonl" $run_flags > "$OUT/run-$name.txt" 2>&1 || tail -3 "$OUT/run-$name.txt"
  timeout 300 titan-run "$art" --steps 12 --device cuda --no-cuda-graphs --metrics "$OUT/ops-$name.jsonl" $run_flags > "$OUT/ops-$name.txt" 2>&1
  peak=$(grep -o 'peak GPU memory [^;(]*' "$OUT/run-$name.txt" | head -1)
  printf '%-18s %-6s %-24s %-24s %-12s %-12s %s\n' "$name" "$need" "$verdict" "$verdict_ops" "$(median_step "$OUT/run-$name.jsonl" || echo failed)" "$(median_step "$OUT/ops-$name.jsonl" || echo failed)" "$peak" >> "$OUT/pipeline.txt"
  case $name in *-cap) echo "$name: $(grep -m1 'MoE capacity overflow' "$OUT/run-$name.txt")";; esac
  echo "$name done at $(elapsed) s"
done
cat "$OUT/pipeline.txt"
