python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TITAN_CACHE_DIR=/tmp/titan-cache
L=${L:-fsdp4}; F="--dp-shard 4"; [ $L = tp4 ] && F="--tp 4"
NOEX=$(python3 -c "from titan.builder.passes import default_passes as d; print(','.join(p for p in d({'dp_shard': 4 if '$L'=='fsdp4' else 1}) if p!='fuse_exact'))")
t0=$(date +%s)
for v in "" "--passes $NOEX" "--fuse"; do titan-build --dtype bf16 --jobs 8 $F $v --out /tmp/art-$RANDOM > /dev/null 2>&1 & done
titan-build --flavor debug --dtype bf16 --tp 2 --out artifacts/dbg > /dev/null 2>&1
timeout 120 titan-verify artifacts/dbg --steps 5 --device cuda 2>&1 | grep -v "^\[rank" | grep "fusion\|bitwise"
wait; echo "builds done $(( $(date +%s) - t0 )) s"; ls $TITAN_CACHE_DIR; du -sh $TITAN_CACHE_DIR/kernels
timeout 420 python3 benchmarks/train_bench.py --layout $L --steps 12 --modes ${MODES:-eager,compile,titan-noexact,titan,titan-fuse} --json $OUT/bench-$L.json > $OUT/bench-$L.txt 2>&1
echo "bench exit $? $(( $(date +%s) - t0 )) s"
grep -h "^fusion:" $OUT/bench-$L.txt | sort | uniq -c
grep -v "^\[rank\|^W1\|^I1" $OUT/bench-$L.txt | tail -9
