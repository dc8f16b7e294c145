"""The closing tables of benchmarks/gpu/gpu_issue30.sh, compact (the start-up table last):

    python benchmarks/issue30_report.py [--steady SEQ=peers.json ...] [--profile SEQ=DIR ...]
        [--startup startup.json]

- where each row's step time goes (profile_steps.py's summaries of the last two steps, ms per
  step), with the matmuls' achieved TFLOP/s (6 x the linear layers' parameters x tokens, over
  the matmul kernels' time) against the bf16 8192^3 matmul train_bench.py measured in the run;
- steady state per sequence length (train_bench.py's JSON): tokens/s, x the best peer row, and
  issue 30's targets (titan >= 1.03x, titan-fuse >= 1.10x the best peer);
- start-up (startup_table.py's JSON) with its targets.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from profile_steps import COLUMNS, category  # noqa: E402

STEADY_TARGETS = {"titan": 1.03, "titan-fuse": 1.10}

def matmul_flops_per_token(flavor: str) -> float:
    """Forward and backward of every linear layer (q, k, v, o, the SwiGLU three, the output)."""
    from plain_llama import SHAPES  # the shapes every row trains

    s = SHAPES[flavor]
    kv = s.n_kv_heads * s.head_dim
    return 6 * (s.n_layers * (2 * s.dim * s.dim + 2 * s.dim * kv + 3 * s.dim * s.ffn_hidden) + s.vocab_size * s.dim)


def pairs(values: list[str]) -> list[tuple[str, str]]:
    return [tuple(v.split("=", 1)) for v in values]


def print_steady(seq: str, path: Path) -> dict:
    data = json.loads(path.read_text())
    print(f"== steady state: {data['flavor']} seq {data['seq_len']} batch {data['batch_size']}, one GPU; "
          f"bf16 matmul measured {data['matmul_tflops']:.0f} TFLOP/s; median step of steps 3..{data['steps']}")
    print(f"{'mode':15s}{'tok/s':>9s}{'x best peer':>12s}{'MFU meas':>9s}{'1st step s':>11s}{'peak GiB':>9s}"
          f"{'loss 1..3':>22s}")
    best = None
    for _, results in data["rows"]:
        for mode, r in results.items():
            if "failed" in r:
                print(f"{mode:15s}  FAILED: {r['failed'][:160]}")
                continue
            best = r.get("best_peer") or best
            losses = " ".join(f"{x:.3f}" for x in r["losses"][:3])
            print(f"{mode:15s}{r['tokens_per_s_per_gpu']:9,.0f}{r['x_best_peer']:12.3f}{r['mfu_measured']:9.3f}"
                  f"{r['first_step_s']:11.1f}{r['peak_gib']:9.1f}{losses:>22s}")
        for mode, target in STEADY_TARGETS.items():
            r = results.get(mode, {})
            if "x_best_peer" in r and best:
                met = "met" if r["x_best_peer"] >= target else "NOT met"
                print(f"target {mode} >= {target:.2f}x best peer ({best}): {r['x_best_peer']:.3f}x, {met}")
    return data


def print_profile(seq: str, folder: Path, steady: dict | None) -> None:
    summaries = {p.name.removesuffix(".summary.json").removeprefix("single-"): json.loads(p.read_text())
                 for p in sorted(folder.glob("*.summary.json"))}
    if not summaries:
        print(f"== profile seq {seq}: no summaries in {folder}")
        return
    peak = steady.get("matmul_tflops") if steady else None
    peak = peak if peak and not math.isnan(peak) else None  # nan: measured without a GPU
    flops = matmul_flops_per_token(steady["flavor"]) * steady["seq_len"] * steady["batch_size"] if steady else None
    print(f"== where the step time goes, seq {seq}: ms per step (rank 0, last two steps); matmul TFLOP/s = "
          f"linear-layer FLOPs / matmul kernel time" + (f", x peak against {peak:.0f}" if peak else ""))
    names = [("matmul", "matmul"), ("attention", "attn"), ("elementwise/reductions", "elem/norm"), ("loss", "loss"),
             ("optimizer", "optim"), ("nccl", "nccl")]
    print(f"{'row':15s}" + "".join(f"{short:>10s}" for _, short in names) + f"{'idle':>7s}{'window':>8s}"
          f"{'mm TFLOP/s':>11s}{'x peak':>7s}")
    columns = dict(COLUMNS)
    for label, s in summaries.items():
        if not s.get("kernels"):
            print(f"{label:15s} no kernels recorded")
            continue
        cells = {name: sum(s["categories"][m]["ms"] for m in columns[name] if m in s["categories"]) for name, _ in names}
        line = f"{label:15s}" + "".join(f"{cells[name]:10.1f}" for name, _ in names)
        line += f"{s['idle_ms']:7.1f}{s['window_ms']:8.1f}"
        if flops and cells["matmul"] > 0:
            achieved = flops / (cells["matmul"] / 1e3) / 1e12
            line += f"{achieved:11.0f}" + (f"{achieved / peak:7.2f}" if peak else "")
        print(line)
    for label, s in summaries.items():  # which attention each row ran (cuDNN, flash, efficient)
        top = next((t for t in s.get("top_kernels", []) if category(t["name"]) == "attention"), None)
        if top:
            print(f"  {label}: attention's top kernel {top['ms']:.1f} ms x{top['count']}: {top['name'][:80]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steady", action="append", default=[], help="SEQ=train_bench JSON")
    p.add_argument("--profile", action="append", default=[], help="SEQ=BENCH_PROFILE folder")
    p.add_argument("--startup", default=None, help="startup_table.py's JSON")
    a = p.parse_args()
    steady = {seq: json.loads(Path(f).read_text()) for seq, f in pairs(a.steady) if Path(f).is_file()}
    for seq, folder in pairs(a.profile):
        print_profile(seq, Path(folder), steady.get(seq))
    for seq, f in pairs(a.steady):
        if Path(f).is_file():
            print_steady(seq, Path(f))
        else:
            print(f"== steady state seq {seq}: no results ({f})")
    if a.startup:
        from startup_table import print_table
        if Path(a.startup).is_file():
            data = json.loads(Path(a.startup).read_text())
            print_table(data["rows"], flavor=data["flavor"], seq_len=data["seq_len"], steps=data["steps"],
                        repeat=len(data["rounds"]))
        else:
            print(f"== start-up: no results ({a.startup})")


if __name__ == "__main__":
    main()
