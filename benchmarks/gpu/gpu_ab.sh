#!/bin/bash
# The titan row of train_bench.py for this tree against an older one, alternating in one call,
# with the plain-compile peer beside the new rows (one GPU):
#
#     git archive OLD_COMMIT builder runtime cli | tar -x -C .lead/old     # here, before the call
#     OLD=.lead/old bash benchmarks/gpu/gpu_ab.sh                          # carry .lead
#
# The older tree runs through a PYTHONPATH shim (its titan.builder, titan.runtime, titan.cli
# first on the path), so each row builds with its own builder (the builder version differs:
# no cache hit across them) and trains with its own runtime. SEQ (8192), STEPS (20), ROUNDS (2).
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh"
OLD=${OLD:?OLD=DIR: a tree with the older builder/, runtime/ and cli/}
SEQ=${SEQ:-8192} STEPS=${STEPS:-20} ROUNDS=${ROUNDS:-2}
install_titan
mkdir -p /tmp/oldshim/titan
for d in builder runtime cli; do ln -sfn "$(cd "$OLD" && pwd)/$d" "/tmp/oldshim/titan/$d"; done
row() {  # NAME MODES [old]
  timeout 200 env ${3:+PYTHONPATH=/tmp/oldshim} python3 benchmarks/train_bench.py --flavor "${FLAVOR:-1B}" \
    --seq-len "$SEQ" --batch-size 1 --layout single --steps "$STEPS" --max-norm 1.0 --modes "$2" \
    --json "$OUT/$1.json" > "$OUT/$1.txt" 2>&1
  echo "== $1: exit $? [$(elapsed) s]"; grep -E "^single .*(FAILED|tok/s)" "$OUT/$1.txt" | cut -c1-110
}
for r in $(seq "$ROUNDS"); do
  row "new$r" titan,plain-compile
  row "old$r" titan old
done
