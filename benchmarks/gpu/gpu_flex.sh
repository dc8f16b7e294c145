#!/usr/bin/env bash
# GPU-host run, one GPU (nvidia-h100-x1): FlexAttention's fused kernels in titan (issue 31).
#   bash benchmarks/gpu/gpu_flex.sh                 (all parts, in this order: verify mla offline bench ops;
#                                                    about 25 minutes: split it over calls)
#   PARTS="verify ops" bash benchmarks/gpu/gpu_flex.sh;  PARTS="bench offline" bash benchmarks/gpu/gpu_flex.sh
#   PARTS="mla" bash benchmarks/gpu/gpu_flex.sh     (DeepSeek-V3's latent attention alone, ~5 minutes)
# Needs for `bench`'s torchtitan rows the peer wheels in .whl/ (as gpu_peers.sh).
#  0. titan (editable) unless importable; token files of random documents (flex_check.py
#     documents): debug (vocab 2048, separator 2047, 16-300 tokens) and 1B (vocab 128256,
#     separator 128001, 64-4096 tokens): boundaries at other places in every batch.
#  ops:     flex_check.py ops: the block mask against torch's create_block_mask, the kernels
#           against the dense reference and against torch.compile(flex_attention), a CUDA graph
#           replayed with new boundaries, forward + backward ms at 1B's shape vs SDPA; then
#           tests/gpu/test_flex_cuda.py.
#  verify:  titan-verify --device cuda --deterministic (CUDA graphs on: captured once, replayed
#           with each step's boundaries) of debug seq 512 and 1B seq 8192 flex document on the
#           documents, from an empty kernel store (the flex kernels compiled here, once, and
#           shared by the eager reference and the artifact): bitwise yes/no.
#  mla:     the same for DeepSeek-V3's multi-head latent attention through the flex op, its
#           values at their own head size (debug: q/k 24, v 16, not powers of two; 16B-4L: q/k
#           192, v 128, the 16B and 671B sizes): debug bf16 seq 512 and 16B-4L seq 2048 batch 1,
#           flex document on documents of their vocabularies (separators 511 and 102399).
#  offline: the same for artifacts/flex-offline-debug and -1b if carried, built without a GPU:
#             titan-build --flavor debug --dtype bf16 --seq-len 512 --attention flex --mask document \
#               --eos-id 2047 --kernels --gpu h100 --out artifacts/flex-offline-debug
#             titan-build --flavor 1B --dtype bf16 --seq-len 8192 --attention flex --mask document \
#               --eos-id 128001 --kernels --gpu h100 --out artifacts/flex-offline-1b
#           each from an empty kernel store, its kernels trusted: the fusion line should say every
#           region came from the artifact, the flex kernels line "2 from the artifact" (the eager
#           reference takes them from there too), and bitwise yes.
#  bench:   train_bench.py on the 1B documents, seq 8192, batch 1: titan (SDPA causal),
#           titan-flex-doc, tt-compile (SDPA causal), tt-compile-flex (torchtitan's flex,
#           document mask); tokens/s per GPU.
# A table of every result last.
source "$(dirname "$0")/gpu_common.sh"
export TITAN_CACHE_DIR=$OUT/cache TITAN_KEY_FILE=$OUT/cache.key
PARTS=${PARTS:-verify mla bench ops offline}
STEPS=${STEPS:-12}
install_titan
rm -rf "$OUT/cache"
python3 benchmarks/gpu/flex_check.py documents "$OUT/docs-debug.bin" --vocab 2048 --eos 2047 --tokens 200000 \
  --shortest 16 --longest 300
python3 benchmarks/gpu/flex_check.py documents "$OUT/docs-1b.bin" --vocab 128256 --eos 128001 --tokens 400000 \
  --shortest 64 --longest 4096
python3 benchmarks/gpu/flex_check.py documents "$OUT/docs-ds-debug.bin" --vocab 512 --eos 511 --tokens 100000 \
  --shortest 16 --longest 300
python3 benchmarks/gpu/flex_check.py documents "$OUT/docs-ds-16b.bin" --vocab 102400 --eos 102399 --tokens 200000 \
  --shortest 64 --longest 2048
summary=()
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }

verify() {  # NAME ARTIFACT DATA [extra titan-verify flags]: one bitwise row
  local name=$1 art=$2 data=$3; shift 3
  timeout 400 titan-verify "$art" --steps "${VERIFY_STEPS:-5}" --device cuda --deterministic --data "$data" \
    --json "$OUT/verify-$name.json" "$@" > "$OUT/verify-$name.txt" 2>&1
  local rc=$? bitwise
  bitwise=$(python3 -c "import json,sys; print('yes' if json.load(open(sys.argv[1]))['bitwise_equal'] else 'no')" \
    "$OUT/verify-$name.json" 2>/dev/null || echo "error (exit $rc)")
  echo "   $(grep -m1 '^fusion:' "$OUT/verify-$name.txt")"
  echo "   $(grep -m1 '^flex kernels' "$OUT/verify-$name.txt")"
  grep -E "^error|Error|Traceback" "$OUT/verify-$name.txt" | head -n 5
  summary+=("$(printf '%-34s %s' "verify $name" "bitwise $bitwise (exit $rc)")")
  echo "== verify $name: bitwise $bitwise, exit $rc [$(elapsed) s]"
}

if has verify; then
  echo "== verify [$(elapsed) s]"
  titan-build --flavor debug --dtype bf16 --seq-len 512 --attention flex --mask document --eos-id 2047 \
    --out artifacts/flex-debug > "$OUT/build-debug.txt" 2>&1; echo "build debug: exit $? [$(elapsed) s]"
  titan-build --flavor 1B --dtype bf16 --seq-len 8192 --attention flex --mask document --eos-id 128001 --jobs 8 \
    --out artifacts/flex-1b > "$OUT/build-1b.txt" 2>&1; echo "build 1B: exit $? [$(elapsed) s]"
  verify flex-doc-debug artifacts/flex-debug "$OUT/docs-debug.bin"
  VERIFY_STEPS=${VERIFY_STEPS_1B:-4} verify flex-doc-1b-seq8192 artifacts/flex-1b "$OUT/docs-1b.bin"
fi

if has mla; then
  echo "== mla [$(elapsed) s]"
  titan-build --model deepseek_v3 --flavor debug --dtype bf16 --seq-len 512 --attention flex --mask document \
    --eos-id 511 --out artifacts/flex-ds-debug > "$OUT/build-ds-debug.txt" 2>&1
  echo "build ds debug: exit $? [$(elapsed) s]"
  titan-build --model deepseek_v3 --flavor 16B-4L --seq-len 2048 --batch-size 1 --attention flex --mask document \
    --eos-id 102399 --out artifacts/flex-ds-16b4l > "$OUT/build-ds-16b4l.txt" 2>&1
  echo "build ds 16B-4L: exit $? [$(elapsed) s]"
  grep -h "flex_attention.default" <(titan-show artifacts/flex-ds-debug --graph fw 2>&1) | head -n 1
  verify flex-doc-deepseek-debug artifacts/flex-ds-debug "$OUT/docs-ds-debug.bin"
  VERIFY_STEPS=${VERIFY_STEPS_1B:-4} verify flex-doc-deepseek-16b4l-seq2048 artifacts/flex-ds-16b4l "$OUT/docs-ds-16b.bin"
fi

if has offline; then
  for name in debug 1b; do
    art=artifacts/flex-offline-$name
    if [ -f "$art/manifest.json" ]; then
      TITAN_CACHE_DIR=$OUT/empty-offline-$name VERIFY_STEPS=${VERIFY_STEPS_1B:-4} \
        verify "flex-doc-$name-offline-kernels" "$art" "$OUT/docs-$name.bin" --trust-unsigned-kernels
    else
      summary+=("offline: no $art carried (skipped)")
    fi
  done
fi

if has bench; then
  echo "== bench [$(elapsed) s]"
  if python3 -m pip install -q --no-index --find-links .whl --no-deps --no-compile --no-cache-dir --require-hashes \
       -r benchmarks/peer_wheels.txt --target /tmp/peer-site > "$OUT/peer-install.txt" 2>&1; then
    export PYTHONPATH=/tmp/peer-site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "peer wheels NOT installed (carry .whl): the tt rows will say why"
  fi
  TITAN_BENCH_DATA=$OUT/docs-1b.bin TITAN_BENCH_EOS=128001 BENCH_ROW_TIMEOUT=${BENCH_ROW_TIMEOUT:-240} \
    timeout "${BENCH_TIMEOUT:-560}" python3 benchmarks/train_bench.py --flavor 1B --seq-len 8192 --batch-size 1 \
    --layout single --steps "$STEPS" --modes "${MODES:-titan-flex-doc,titan,tt-compile-flex,tt-compile}" \
    --json "$OUT/flex-bench.json" > "$OUT/flex-bench.txt" 2>&1
  echo "== bench exit $? [$(elapsed) s]"
  grep -E "FAILED|timed out" "$OUT/flex-bench.txt" | head
  python3 - "$OUT/flex-bench.json" <<'EOF' || true
import json, sys
for layout, rows in json.load(open(sys.argv[1]))["rows"]:
    for mode, r in rows.items():
        print(f"bench {layout} {mode:<16} " + (f"FAILED {r['failed'][:200]}" if "failed" in r else
              f"{r['tokens_per_s_per_gpu']:>10,.0f} tokens/s/GPU, peak {r.get('peak_gib', 0):.1f} GiB"))
EOF
fi
if has ops; then
  echo "== ops [$(elapsed) s]"
  timeout 300 python3 benchmarks/gpu/flex_check.py ops 2>&1 | grep -v "^W1\|^I1\|warn" | tail -n 20
  summary+=("ops checks: exit ${PIPESTATUS[0]}")
  timeout 240 python3 -m pytest -q -m gpu tests/gpu/test_flex_cuda.py > "$OUT/gpu-test.txt" 2>&1
  summary+=("tests/gpu/test_flex_cuda.py: $(tail -n 1 "$OUT/gpu-test.txt")")
  grep -E "^(FAILED|E )" "$OUT/gpu-test.txt" | head -20
fi

echo; echo "== summary [$(elapsed) s]"; printf '%s\n' "${summary[@]}"
