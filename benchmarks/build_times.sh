#!/bin/bash
# Cold-build times of the README's three build figures, several runs each, on this machine:
#
#     bash benchmarks/build_times.sh                 # RUNS=3 of each of BUILDS="8b 405b 671b"
#     RUNS=5 BUILDS=8b bash benchmarks/build_times.sh
#
# Each run is `titan-build ARGS --out DIR` under /usr/bin/time with a fresh TITAN_CACHE_DIR, one
# after another. Printed: one line per run as it ends, then the table (minimum / median / maximum
# of wall and of CPU seconds, user + system of titan-build and the processes it waited for).
#
# Why the load and the "probe" columns: on this shared machine the CPU seconds of the same build
# are not constant (2026-11-27, the same commit: 25 CPU s on the idle machine of 2026-11-25, 80
# at a load of 11, 50 nearly idle; docs/performance.md#builds). Before each run the script times
# a fixed piece of Python (the probe; 1.9-3.0 CPU s at loads of 0.5-21 on 2026-11-27), to
# compare sessions. Read the wall figures from runs with a low load.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
RUNS=${RUNS:-3}
BUILDS=${BUILDS:-"8b 405b 671b"}
TITAN_BUILD=${TITAN_BUILD:-titan-build}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

args() {
  case $1 in
    8b) echo --model llama3 --flavor 8B --tp 4;;
    405b) echo --model llama3 --flavor 405B --tp 8 --dp-shard 128;;
    671b) echo --model deepseek_v3 --flavor 671B --tp 8 --ep 64 --dp-shard 4;;
    *) echo "error: unknown build '$1' (BUILDS takes 8b, 405b, 671b)" >&2; exit 2;;
  esac
}

probe() {  # CPU seconds of a fixed piece of Python: small objects made and walked, then a loop
  python3 -c '
import time
t = time.process_time()
d = {}
for i in range(1_000_000):
    d[(i, str(i))] = [i]
s = sum(len(k[1]) for k in d)
x = 0
for i in range(5_000_000):
    x += i & 7
print(f"{time.process_time() - t:.2f}")'
}

load() { cut -d' ' -f1 /proc/loadavg; }

for b in $BUILDS; do args "$b" > /dev/null || exit 2; done
echo "titan build times: $(git rev-parse --short HEAD 2>/dev/null), $(nproc) cores, RUNS=$RUNS, $(date -u +%FT%TZ)"
for b in $BUILDS; do
  a=$(args "$b") || exit 2
  for r in $(seq 1 "$RUNS"); do
    cache=$(mktemp -d "$WORK/cache.XXXX")
    p=$(probe); l0=$(load)
    TITAN_CACHE_DIR=$cache /usr/bin/time -f "%e %U %S %M" -o "$WORK/time" \
      $TITAN_BUILD $a --out "$WORK/out-$b" > "$WORK/log" 2>&1
    rc=$?
    l1=$(load)
    if [ $rc != 0 ]; then
      echo "error: titan-build $a exited $rc:"; tail -5 "$WORK/log"; exit 1
    fi
    read -r wall user sys rss < "$WORK/time"
    cpu=$(python3 -c "print(f'{$user + $sys:.1f}')")
    echo "$b $r: wall $wall s, CPU $cpu s (user $user, sys $sys), max RSS $((rss / 1024)) MiB, load $l0 -> $l1, probe $p s"
    echo "$b $wall $cpu $l0 $l1 $p" >> "$WORK/runs"
    rm -rf "$cache" "$WORK/out-$b"
  done
done

python3 - "$WORK/runs" <<'EOF'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    b, *vals = line.split()
    rows.setdefault(b, []).append([float(v) for v in vals])
def mmm(xs):
    return f"{min(xs):.1f} / {statistics.median(xs):.1f} / {max(xs):.1f}"
print()
print("| build | runs | wall s (min / median / max) | CPU s (min / median / max) | load (1 min) | probe s |")
print("|---|---|---|---|---|---|")
for b, rs in rows.items():
    wall, cpu, l0, l1, p = zip(*rs)
    print(f"| {b} | {len(rs)} | {mmm(wall)} | {mmm(cpu)} | {min(l0 + l1):.2f}-{max(l0 + l1):.2f} "
          f"| {min(p):.2f}-{max(p):.2f} |")
EOF
