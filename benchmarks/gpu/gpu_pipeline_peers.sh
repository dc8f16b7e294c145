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
# Carry .whl (bash benchmarks/fetch_peer_wheels.sh here) for the tt rows. Each layout is one
# train_bench run with its share of BENCH_TIMEOUT (540 s), writing $OUT/pipeline-peers-LAYOUT.json
# (after every row) and $OUT/pipeline-peers-LAYOUT.txt (every row's rank-0 log); the titan
# artifacts are built in the background first (logs $OUT/build-LAYOUT.txt; the builds overlap
# the first rows, which can lengthen their first step, not their GPU-bound steady steps). Prints
# the compact table last (tok/s/GPU, median step, peak memory, first step, x best peer, losses).
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh"
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
case $NGPU in
  2) default_layouts="pp2 pp2-zbv";;
  4) default_layouts="pp4 pp2-tp2";;
  *) [ -n "${LAYOUTS:-}" ] || { echo "error: NGPU=$NGPU has no default layouts: set NGPU=2 or 4, or LAYOUTS"; exit 2; };;
esac
LAYOUTS=${LAYOUTS:-$default_layouts}
MODES=${MODES:-tt-compile,titan,tt-eager,ref-compile,ref-eager,titan-nocg,eager}
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
n_layouts=$(echo $LAYOUTS | wc -w)
rm -f "$OUT/builds.txt"
for l in $LAYOUTS; do
  # The pipeline (schedule, micro-batches, stage split; the same in every row), and its titan
  # artifact built in the background now (nice, 4 jobs): train_bench's own titan-build is then a
  # cache hit (its flags are these).
  python3 benchmarks/bench_pipeline.py "$l" --flavor "$FLAVOR" --seq-len "$SEQ_LEN" --microbatches "$MICROBATCHES"
  flags=$(python3 benchmarks/bench_pipeline.py "$l" --flavor "$FLAVOR" --seq-len "$SEQ_LEN" \
          --microbatches "$MICROBATCHES" --titan-build-flags) || continue
  ( nice titan-build --flavor "$FLAVOR" --seq-len "$SEQ_LEN" --batch-size 1 --dtype bf16 --jobs 4 $flags \
      --out "artifacts/pipeline-peers-$l" --replace > "$OUT/build-$l.txt" 2>&1
    echo "built $l: exit $? at $(elapsed) s" >> "$OUT/builds.txt" ) &
done
rm -f "$OUT"/pipeline-peers-*.json
for l in $LAYOUTS; do  # one bench per layout, each with its share of BENCH_TIMEOUT
  timeout $(( ${BENCH_TIMEOUT:-540} / n_layouts )) python3 benchmarks/train_bench.py --flavor "$FLAVOR" \
    --seq-len "$SEQ_LEN" --batch-size 1 --microbatches "$MICROBATCHES" --layout "$l" --steps "$STEPS" --modes "$MODES" \
    --json "$OUT/pipeline-peers-$l.json" > "$OUT/pipeline-peers-$l.txt" 2>&1
  echo "== $l: bench exit $? [$(elapsed) s]"
  grep -E "^($l [^ ]+: |error:)" "$OUT/pipeline-peers-$l.txt" | cut -c1-300
done
wait
cat "$OUT/builds.txt" 2>/dev/null
python3 - "$OUT" $LAYOUTS <<'PY'
import json, pathlib, sys
sys.path.insert(0, "benchmarks")
from bench_table import print_compact
runs = [json.loads(f.read_text()) for l in sys.argv[2:] if (f := pathlib.Path(sys.argv[1]) / f"pipeline-peers-{l}.json").exists()]
if not runs:
    sys.exit("no layout finished a row")
run = runs[0]
print(f"\n{run['flavor']}, seq {run['seq_len']}, {run['microbatches']} micro-batches of {run['batch_size']} per step; "
      f"bf16 matmul {run['matmul_tflops']:.0f} TFLOP/s; median step of steps 3..{run['steps']}")
print_compact([row for r in runs for row in r["rows"]], {k: v for r in runs for k, v in r.get("pipelines", {}).items()})
PY
