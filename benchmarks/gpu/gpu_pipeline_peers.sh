#!/usr/bin/env bash
# Pipeline throughput against the peers (issue 28): one train_bench.py run per layout on the GPUs
# of one host, every row on the same schedule, micro-batches and stage split
# (benchmarks/bench_pipeline.py; titan's cost-balanced split, given to each row):
#   titan        titan-build --pp ... artifact, titan-run (default flags)
#   titan-nocg   the same artifact, titan-run --no-cuda-graphs
#   tt-compile   torchtitan 0.2.2's own pipeline (its TrainSpec's pipelining_fn), per-block compile
#   tt-eager     the same without compile
#   ref-compile  the plain-PyTorch Llama of peer_ref.py under torch.distributed.pipelining, compiled
#   ref-eager    the same without compile
#   eager        titan's model under torch.distributed.pipelining (titan-verify's reference: titan's
#                default mode is bitwise equal to it)
# Llama-3 1B, seq 2048, MICROBATCHES (8) micro-batches of one sequence per step; bf16 compute,
# fp32 master weights and AdamW state in every row; clip 1.0.
#   NGPU=2 bash benchmarks/gpu/gpu_pipeline_peers.sh     # pp2 (1F1B) and pp2-zbv (ZBVZeroBubble)
#   NGPU=4 bash benchmarks/gpu/gpu_pipeline_peers.sh     # pp4 (1F1B) and pp2-tp2 (1F1B)
# LAYOUTS="pp2" (one layout per call if 10 minutes are short), MODES=..., STEPS, SEQ_LEN, FLAVOR.
# Carry .whl (bash benchmarks/fetch_peer_wheels.sh here) for the tt rows. Writes
# $OUT/pipeline-peers.json (after every row) and $OUT/pipeline-peers.txt (every row's rank-0 log);
# prints the compact table last (tok/s/GPU, median step, peak memory, x best peer).
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh"
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
case $NGPU in
  2) default_layouts="pp2 pp2-zbv";;
  4) default_layouts="pp4 pp2-tp2";;
  *) echo "error: NGPU=$NGPU: set NGPU=2 or NGPU=4 (or LAYOUTS=...)"; [ -n "${LAYOUTS:-}" ] || exit 2;;
esac
LAYOUTS=${LAYOUTS:-$default_layouts}
MODES=${MODES:-titan,tt-compile,tt-eager,ref-compile,ref-eager,eager,titan-nocg}
FLAVOR=${FLAVOR:-1B}
SEQ_LEN=${SEQ_LEN:-2048}
MICROBATCHES=${MICROBATCHES:-8}
STEPS=${STEPS:-12}
export BENCH_ROW_TIMEOUT=${BENCH_ROW_TIMEOUT:-150}

install_titan
install_peer_wheels
python3 - <<'PY'
import importlib.metadata as md, torch
gpus = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no GPU"
try:
    import torchtitan.train, torchtitan.models.llama3, torchtitan.distributed.pipeline_parallel
    tt = f"torchtitan {md.version('torchtitan')} imports"
except Exception as e:
    tt = f"torchtitan does not import: {type(e).__name__}: {e}"
print(f"== torch {torch.__version__}, {gpus}, {tt}")
PY
for l in $LAYOUTS; do  # each pipeline: schedule, micro-batches, stage split (the same in every row)
  python3 benchmarks/bench_pipeline.py "$l" --flavor "$FLAVOR" --seq-len "$SEQ_LEN" --microbatches "$MICROBATCHES"
done
timeout "${BENCH_TIMEOUT:-540}" python3 benchmarks/train_bench.py --flavor "$FLAVOR" --seq-len "$SEQ_LEN" --batch-size 1 \
  --microbatches "$MICROBATCHES" $(for l in $LAYOUTS; do echo --layout "$l"; done) --steps "$STEPS" --modes "$MODES" \
  --json "$OUT/pipeline-peers.json" > "$OUT/pipeline-peers.txt" 2>&1
echo "== bench exit $? [$(elapsed) s]"
grep -E "^(pp[^ ]* [^ ]+: |error:)" "$OUT/pipeline-peers.txt" | cut -c1-300
python3 - "$OUT/pipeline-peers.json" <<'PY'
import json, sys
sys.path.insert(0, "benchmarks")
from bench_table import print_compact
run = json.load(open(sys.argv[1]))
print(f"\n{run['flavor']}, seq {run['seq_len']}, {run['microbatches']} micro-batches of {run['batch_size']} per step; "
      f"bf16 matmul {run['matmul_tflops']:.0f} TFLOP/s; median step of steps 3..{run['steps']}")
print_compact(run["rows"], run.get("pipelines"))
PY
