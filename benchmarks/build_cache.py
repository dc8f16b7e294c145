"""Build-cache benchmark: cold build vs cache hit, per layout, in fresh temporary caches.

    python benchmarks/build_cache.py [--hits 5] [--layout "debug --tp 2 --dp-shard 2"] ...

Prints one row per layout: ranks, distinct graph blobs after rank dedupe, cold build time,
and the median wall time of titan-build on a hit (a whole process, as a user runs it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from titan.runtime.contract.artifact import open_artifact

DEFAULT_LAYOUTS = ["debug --tp 2 --dp-shard 2", "8B --tp 4"]


def timed_build(args: list[str], out: Path, cache: Path) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "titan.cli.build", *args, "--out", str(out)],
                       env=dict(os.environ, TITAN_CACHE_DIR=str(cache)), capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(r.stderr)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hits", type=int, default=5)
    p.add_argument("--layout", action="append", help='flavor and flags, e.g. "8B --tp 4"')
    opts = p.parse_args()
    rows = []
    for layout in opts.layout or DEFAULT_LAYOUTS:
        flavor, *flags = layout.split()
        args = ["--flavor", flavor, *flags]
        with tempfile.TemporaryDirectory() as tmp:
            cache, out = Path(tmp) / "cache", Path(tmp) / "art"
            cold = timed_build(args, out, cache)
            hits = [timed_build(args, out, cache) for _ in range(opts.hits)]
            manifest = open_artifact(out).manifest
            graphs = sum(rel.startswith("graphs/") for rel in manifest.files)
            rows.append((layout, manifest.world_size, graphs, 2 * manifest.world_size, cold,
                         statistics.median(hits)))
    print(f"{'layout':<28}{'ranks':>6}{'graph blobs':>13}{'(undeduped)':>13}{'cold s':>9}{'hit s':>8}")
    for layout, ranks, graphs, naive, cold, hit in rows:
        print(f"{layout:<28}{ranks:>6}{graphs:>13}{naive:>13}{cold:>9.1f}{hit:>8.2f}")


if __name__ == "__main__":
    main()
