"""Where a training step's GPU time goes: a torch.profiler window over the last steps of a
run, summed up by kernel category, with how much of the collectives' time no compute hid.

Used by train_bench.py when BENCH_PROFILE=DIR is set (rank 0 of every row is profiled over
its last two steps), and on its own for a titan artifact:

    python benchmarks/profile_steps.py ARTIFACT --steps 8 --out DIR [--label L] [--no-cuda-graphs] [--no-fused-adamw]
        (launch one process per rank with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* set)

Each profiled rank writes DIR/LABEL.summary.json and prints a table; set BENCH_KEEP_TRACE=1 to
keep the chrome trace (DIR/LABEL.trace.json) as well.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# First match wins; names are lower-cased kernel names.
CATEGORIES = [
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_", "sm100_")),
    ("generated (triton)", ("triton",)),
    ("optimizer ops", ("lerp", "addcmul", "addcdiv", "sqrt", "multi_tensor_apply", "adam")),
    ("loss", ("nll_loss", "cross_entropy", "log_softmax", "logsoftmax")),
    ("reduction", ("reduce_kernel", "softmax", "norm")),
    ("copy / cat", ("copy", "memcpy", "memset", "cat", "splitwithsizes", "split_with_sizes", "index")),
    ("elementwise", ("elementwise",)),
]


def category(name: str) -> str:
    low = name.lower()
    for label, keys in CATEGORIES:
        if any(k in low for k in keys):
            return label
    return "other"


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(trace: dict, steps: int) -> dict:
    """Per-step GPU times (ms) from a chrome trace: by category, busy / idle, collectives hidden."""
    kernels = [e for e in trace.get("traceEvents", [])
               if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        return {"steps": steps, "kernels": 0}
    by_cat: dict[str, list[float]] = {}
    by_name: dict[str, list[float]] = {}
    comm, compute = [], []
    for e in kernels:
        name, t0, dur = e["name"], float(e["ts"]), float(e["dur"])
        cat = category(name)
        by_cat.setdefault(cat, [0.0, 0])
        by_cat[cat][0] += dur
        by_cat[cat][1] += 1
        by_name.setdefault(name, [0.0, 0])
        by_name[name][0] += dur
        by_name[name][1] += 1
        (comm if cat == "nccl" else compute).append((t0, t0 + dur))
    start = min(a for a, _ in comm + compute)
    end = max(b for _, b in comm + compute)
    comm_u, compute_u = _union(comm), _union(compute)
    busy = _length(_union(comm + compute))
    per = 1e3 * steps  # us -> ms per step
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:20]
    return {
        "steps": steps,
        "kernels": len(kernels) // steps,
        "window_ms": (end - start) / per,
        "busy_ms": busy / per,
        "idle_ms": (end - start - busy) / per,
        "compute_ms": _length(compute_u) / per,
        "nccl_ms": _length(comm_u) / per,
        "nccl_exposed_ms": (_length(comm_u) - _intersection(comm_u, compute_u)) / per,
        "categories": {k: {"ms": v[0] / per, "count": v[1] // steps}
                       for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1][0])},
        "top_kernels": [{"name": k[:160], "ms": v[0] / per, "count": v[1] // steps} for k, v in top],
    }


def table(label: str, s: dict) -> str:
    if not s.get("kernels"):
        return f"{label}: no kernels recorded"
    lines = [f"{label}: per step {s['window_ms']:.1f} ms GPU window, busy {s['busy_ms']:.1f}, idle "
             f"{s['idle_ms']:.1f}; compute {s['compute_ms']:.1f}, nccl {s['nccl_ms']:.1f} "
             f"(exposed {s['nccl_exposed_ms']:.1f}); {s['kernels']} kernels"]
    for k, v in s["categories"].items():
        lines.append(f"  {k:20s} {v['ms']:8.1f} ms  {v['count']:6d}")
    for t in s["top_kernels"][:12]:
        lines.append(f"    {t['ms']:7.1f} ms {t['count']:5d}x {t['name'][:110]}")
    return "\n".join(lines)


# The side-by-side view (compare_table): the categories above, in fewer columns. Generated
# (Triton) kernels are fused element-wise / reduction work; a fused loss lands there too.
COLUMNS = [("matmul", ("matmul",)), ("attention", ("attention",)),
           ("elementwise/reductions", ("elementwise", "reduction", "generated (triton)", "copy / cat", "other")),
           ("loss", ("loss",)), ("optimizer", ("optimizer ops",)), ("nccl", ("nccl",))]


def compare_table(summaries: dict[str, dict]) -> str:
    """Rows side by side, ms per step: kernel time by column, GPU idle inside the window, and
    the window (first kernel to last)."""
    head = f"{'row':24s}" + "".join(f"{name:>23s}" if len(name) > 10 else f"{name:>11s}" for name, _ in COLUMNS)
    lines = [head + f"{'idle':>8s}{'window':>9s}"]
    for label, s in summaries.items():
        if not s.get("kernels"):
            lines.append(f"{label:24s} no kernels recorded")
            continue
        cats = s["categories"]
        cells = []
        for name, members in COLUMNS:
            ms = sum(cats[m]["ms"] for m in members if m in cats)
            cells.append(f"{ms:{23 if len(name) > 10 else 11}.1f}")
        lines.append(f"{label:24s}" + "".join(cells) + f"{s['idle_ms']:8.1f}{s['window_ms']:9.1f}")
    return "\n".join(lines)


class StepProfiler:
    """on_step hook: profiles steps first..last (1-based), then writes the summary."""

    def __init__(self, out_dir: str | Path, label: str, first: int, last: int):
        self.out = Path(out_dir)
        self.label, self.first, self.last = label, first, last
        self.prof = None

    def __call__(self, step: int) -> None:
        import torch
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        if step == self.first - 1:
            from torch.profiler import ProfilerActivity, profile
            sync()
            gpu = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            self.prof = profile(activities=[ProfilerActivity.CPU, *gpu])
            self.prof.start()
        elif step == self.last and self.prof is not None:
            sync()
            self.prof.stop()
            self.out.mkdir(parents=True, exist_ok=True)
            trace = self.out / f"{self.label}.trace.json"
            self.prof.export_chrome_trace(str(trace))
            summary = summarize(json.loads(trace.read_text()), self.last - self.first + 1)
            (self.out / f"{self.label}.summary.json").write_text(json.dumps(summary, indent=1))
            if os.environ.get("BENCH_KEEP_TRACE") != "1":
                trace.unlink()
            print(table(self.label, summary), flush=True)


def step_profiler_from_env(label: str, steps: int, rank: int) -> StepProfiler | None:
    """A benchmark worker's on_step hook: its rank 0 profiled when BENCH_PROFILE=DIR is set."""
    if not os.environ.get("BENCH_PROFILE") or rank != 0:
        return None
    return StepProfiler(os.environ["BENCH_PROFILE"], label, *window(steps))


def window(steps: int) -> tuple[int, int]:
    """The last two steps (1-based), leaving at least two before them to warm up."""
    if steps < 4:
        raise SystemExit("profiling needs --steps 4 or more")
    return steps - 1, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="titan")
    ap.add_argument("--metrics", default=None)
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--no-fused-adamw", action="store_true")
    ap.add_argument("--max-norm", type=float, default=None)
    args = ap.parse_args()
    from titan.runtime.distributed import exit_rank
    from titan.runtime.run_config import RunConfig
    from titan.runtime.train import rank_main, run_rank

    cfg = RunConfig(steps=args.steps, metrics=args.metrics, quiet=True, cuda_graphs=not args.no_cuda_graphs,
                    fused_adamw=not args.no_fused_adamw, max_norm=args.max_norm,
                    compile_in_background=False)  # the profiled steps run on the kernels
    first, last = window(args.steps)

    def work(artifact, cfg, env) -> int:
        hook = StepProfiler(args.out, args.label, first, last) if env.rank == 0 else None
        run_rank(artifact, cfg, env, on_step=hook)
        return 0

    exit_rank(rank_main(args.artifact, cfg, work=work))


if __name__ == "__main__":
    sys.exit(main())
