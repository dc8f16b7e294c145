#!/usr/bin/env bash
# GPU-host run, one call: titan against its peers, one table (benchmarks/README.md, "peers").
#   one GPU (nvidia-h100-x1 or nvidia-h200), Llama-3 1B, seq 8192, batch 1, world size 1:
#       bash benchmarks/gpu/gpu_peers.sh
#   4 or 8 GPUs, 8B:  FLAVOR=8B LAYOUTS="fsdp4 tp4" bash benchmarks/gpu/gpu_peers.sh
#                     FLAVOR=8B LAYOUTS=dp2tp4 bash benchmarks/gpu/gpu_peers.sh      (8 GPUs)
# Needs the peer wheels in .whl/ (here: bash benchmarks/fetch_peer_wheels.sh; the device call
# carries .whl). Steps:
#  1. titan itself (editable, no dependencies) unless importable, and the pinned peer wheels
#     (benchmarks/peer_wheels.txt, hashes checked) into /tmp/peer-site on PYTHONPATH;
#  2. in the background, the titan artifacts of FLAVOR x LAYOUTS (default passes, and --fuse
#     when MODES has titan-fuse) into the call's build cache: train_bench's own titan-build
#     calls are then cache hits. Rows that need no artifact come first in MODES and run
#     meanwhile (a titan row that starts before its build is done builds it itself);
#  3. train_bench.py over MODES (each row stopped after BENCH_ROW_TIMEOUT s); raw numbers
#     $OUT/peers.json (written after every row), full log $OUT/peers.txt; the table last.
# BENCH_PROFILE=1 (or a folder): every row's rank 0 also profiles its last two steps (dropped from
# the medians; profile_steps.py); $OUT/profile.json has the summaries, and a last table shows
# the rows side by side, ms per step by kernel kind (matmul, attention, element-wise /
# reductions, loss, optimizer, nccl) and GPU idle: where titan's time goes against the peers'.
source "$(dirname "$0")/gpu_common.sh"
FLAVOR=${FLAVOR:-1B}
LAYOUTS=${LAYOUTS:-single}
MODES=${MODES:-ref-eager,ref-compile,eager,titan,titan-fuse,tt-eager,tt-compile,tt-toolkit}
STEPS=${STEPS:-12}
SEQ_LEN=${SEQ_LEN:-8192}
BATCH=${BATCH:-1}
export BENCH_ROW_TIMEOUT=${BENCH_ROW_TIMEOUT:-150}
if [ -n "${BENCH_PROFILE:-}" ]; then
  [ "$BENCH_PROFILE" = 1 ] && BENCH_PROFILE=/tmp/peers-profile
  rm -rf "$BENCH_PROFILE"
  export BENCH_PROFILE
fi

install_titan
install_peer_wheels
python3 - <<'EOF'
import importlib.metadata as md, torch
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "missing"
gpus = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no GPU"
try:  # what the torchtitan rows import, before they run
    import torchtitan.train, torchtitan.models.llama3, torchtitan.experiments.compiler_toolkit.train
    import torchtitan.experiments.compiler_toolkit.llama3
    imports = "imports"
except Exception as e:
    imports = f"does not import: {type(e).__name__}: {e}"
print(f"== torch {torch.__version__}, {gpus}, torchtitan {version('torchtitan')} {imports}")
EOF
build_layouts "$(has_fuse)"
timeout "${BENCH_TIMEOUT:-520}" python3 benchmarks/train_bench.py --flavor "$FLAVOR" --seq-len "$SEQ_LEN" --batch-size "$BATCH" \
  $(for l in $LAYOUTS; do echo --layout "$l"; done) --steps "$STEPS" --modes "$MODES" --json "$OUT/peers.json" \
  > "$OUT/peers.txt" 2>&1
echo "== bench exit $? [$(elapsed) s]"
wait $builds; cat "$OUT/builds.txt"
if grep -q "^bf16 matmul" "$OUT/peers.txt"; then
  sed -n '/^bf16 matmul/,$p' "$OUT/peers.txt"
else  # the bench was stopped: the table of the rows it finished
  python3 -c "import json, sys; sys.path.insert(0, 'benchmarks'); from bench_table import print_table
print_table(json.load(open(sys.argv[1]))['rows'])" "$OUT/peers.json"
fi
if [ -n "${BENCH_PROFILE:-}" ]; then
  echo "== where the time goes, ms per step (rank 0, the last two steps; $OUT/profile.json)"
  python3 - "$BENCH_PROFILE" "$OUT/profile.json" <<'EOF'
import json, pathlib, sys
sys.path.insert(0, "benchmarks")
from profile_steps import compare_table
summaries = {p.name.removesuffix(".summary.json"): json.loads(p.read_text())
             for p in sorted(pathlib.Path(sys.argv[1]).glob("*.summary.json"))}
pathlib.Path(sys.argv[2]).write_text(json.dumps(summaries, indent=1))
print(compare_table(summaries) if summaries else "no profiles written")
EOF
fi
