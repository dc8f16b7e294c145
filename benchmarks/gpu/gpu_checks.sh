#!/usr/bin/env bash
# GPU-host checks for the build/run foundation, in one call: the GPU test marker, titan-verify
# on debug layouts with and without deterministic kernels, and the 8B tp=4 artifact trained for
# 10 steps on NCCL. Writes logs and metrics under ${OUT:-/tmp/titan-gpu}.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/titan-gpu}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
summary=()
note() { summary+=("$1"); echo "== $1"; }

python3 -m pytest -q -m gpu tests/gpu/test_gpu.py -p no:cacheprovider 2>&1 | tail -15
note "gpu tests: exit ${PIPESTATUS[0]}"

for layout in "--tp 2" "--dp-shard 2"; do
  name=debug$(echo "$layout" | tr -d ' -')
  titan-build --flavor debug $layout --out "artifacts/$name" | tail -1
  for det in "" "--deterministic"; do
    titan-verify "artifacts/$name" --steps 10 --device cuda $det > "$OUT/verify-$name$det.txt" 2>&1
    note "verify $name ${det:-default}: $(tail -1 "$OUT/verify-$name$det.txt")"
  done
done

[ "${SKIP_8B:-0}" = 1 ] && { printf '%s\n' "${summary[@]}"; exit 0; }
start=$(date +%s)
titan-build --model llama3 --tp 4 --jobs 4 2>&1 | tee "$OUT/build-8b-tp4.txt" | tail -1
note "8B tp4 build on $(nproc) cores: $(( $(date +%s) - start )) s"
titan-run artifacts/llama3-tp4 --steps 10 --metrics "$OUT/8b-tp4.jsonl" 2>&1 | tee "$OUT/run-8b-tp4.txt" | tail -12
note "8B tp4 run: exit ${PIPESTATUS[0]}; $(tail -1 "$OUT/8b-tp4.jsonl" 2>/dev/null)"
printf '%s\n' "${summary[@]}"
