# Sourced by gpu_exact.sh, gpu_adamw.sh and gpu_profile.sh: the repository root as working
# directory, $OUT, the NCCL settings these hosts need, one build cache for the whole call,
# elapsed, flags LAYOUT, build_layouts, wait_for, install_titan and install_peer_wheels.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-/tmp/titan-gpu}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TITAN_CACHE_DIR=${TITAN_CACHE_DIR:-/tmp/titan-cache}
t_start=$(date +%s)
elapsed() { echo $(( $(date +%s) - t_start )); }
flags() {
  case $1 in
    tp4) echo --tp 4;; fsdp4) echo --dp-shard 4;; dp2tp2) echo --dp-shard 2 --tp 2;; dp2tp4) echo --dp-shard 2 --tp 4;;
    tp2) echo --tp 2;; fsdp2) echo --dp-shard 2;; single) ;;
  esac
}
_build8b() {
  local name=$1; shift
  titan-build --model llama3 ${FLAVOR:+--flavor "$FLAVOR"} ${SEQ_LEN:+--seq-len "$SEQ_LEN"} \
    ${BATCH:+--batch-size "$BATCH"} --dtype bf16 --jobs 8 --out "artifacts/$name" "$@" \
    > "/tmp/titan-build-$name.txt" 2>&1
  echo "built $name: exit $? at $(elapsed) s"
}
# build_layouts FUSE: in the background, the artifact ($FLAVOR, default 8B) of each of $LAYOUTS with the default
# passes (artifacts/LAYOUT) and, when FUSE is 1, with --fuse (artifacts/LAYOUT-fuse); one line
# "built NAME: exit S at T s" each in $OUT/builds.txt (logs in /tmp/titan-build-NAME.txt).
# Sets $builds to the builder's pid.
build_layouts() {
  local fuse=$1 l
  (
    for l in $LAYOUTS; do
      _build8b "$l" $(flags "$l") &
      if [ "$fuse" = 1 ]; then _build8b "$l-fuse" $(flags "$l") --fuse & fi
    done
    wait
  ) > "$OUT/builds.txt" 2>&1 &
  builds=$!
}
# wait_for NAME: until build_layouts has built NAME.
wait_for() { until grep -q "built $1:" "$OUT/builds.txt" 2>/dev/null; do sleep 2; done; }
# has_fuse: whether $MODES has a titan-fuse row (1) or not (0).
has_fuse() { case ${MODES:-} in *titan-fuse*) echo 1;; *) echo 0;; esac; }
# install_titan: titan itself (editable, no dependencies) unless this python already imports it.
install_titan() {
  if ! python3 -c "import titan.cli.build" 2>/dev/null; then
    python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/titan-install.txt" 2>&1
    echo "== titan installed: exit $? [$(elapsed) s]"
  fi
}
# install_peer_wheels: the pinned peer wheels (benchmarks/peer_wheels.txt, hashes checked) from
# .whl/ into /tmp/peer-site, put on PYTHONPATH; says whether it worked (the tt rows say why not).
install_peer_wheels() {
  if python3 -m pip install -q --no-index --find-links .whl --no-deps --no-compile --no-cache-dir --require-hashes \
       -r benchmarks/peer_wheels.txt --target /tmp/peer-site > "$OUT/peer-install.txt" 2>&1; then
    export PYTHONPATH=/tmp/peer-site${PYTHONPATH:+:$PYTHONPATH}
    echo "== peer wheels installed [$(elapsed) s]"
  else
    echo "== peer wheels NOT installed (carry .whl; see $OUT/peer-install.txt): the tt rows will say why"
  fi
}
