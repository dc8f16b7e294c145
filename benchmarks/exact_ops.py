"""Which element-wise ops inductor computes bit for bit as eager does, and what fusing them saves.

For each op and each chain of ops the Llama graphs contain, on one GPU: eager, inductor with
titan's exact settings (runtime/kernels/fusion.py EXACT_CONFIG) and inductor's defaults, on
8192 x 4096 inputs; prints whether each compiled result is torch.equal to eager and the time of
each. titan's exact-fusion pass fuses only ops this table shows equal.

    python benchmarks/exact_ops.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

aten = torch.ops.aten
N, D = 8192, 4096


def inputs(seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s, dt=torch.float32: torch.randn(*s, generator=g, device="cuda", dtype=torch.float32).to(dt)
    bf = torch.bfloat16
    return dict(a=r(N, D, dt=bf), b=r(N, D, dt=bf), c=r(N, D, dt=bf), f=r(N, D), g=r(N, D) + 3.0, h=r(N, D),
                r=r(N, 1).abs() + 0.5, w=r(D, dt=bf), cos=r(N, D // 2), sin=r(N, D // 2))


def rope(a, cos, sin):
    pairs = a.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).type_as(a)


CASES = {
    "mul bf16": lambda t: t["a"] * t["b"],
    "add bf16": lambda t: t["a"] + t["b"],
    "sub bf16": lambda t: t["a"] - t["b"],
    "neg bf16": lambda t: -t["a"],
    "to fp32": lambda t: t["a"].float(),
    "to bf16": lambda t: t["f"].to(torch.bfloat16),
    "mul scalar fp32": lambda t: t["f"] * 0.7,
    "mul scalar bf16": lambda t: t["a"] * 0.7,
    "pow 2 fp32": lambda t: t["f"].pow(2),
    "pow 3 fp32": lambda t: t["f"].pow(3),
    "div scalar fp32": lambda t: t["f"] / 3.0,
    "div tensor fp32": lambda t: t["f"] / t["g"],
    "reciprocal fp32": lambda t: t["g"].reciprocal(),
    "rsqrt fp32": lambda t: t["g"].abs().rsqrt(),
    "exp fp32": lambda t: t["f"].exp(),
    "sigmoid fp32": lambda t: t["f"].sigmoid(),
    "silu bf16": lambda t: F.silu(t["a"]),
    "silu fp32": lambda t: F.silu(t["f"]),
    "silu_backward bf16": lambda t: aten.silu_backward(t["a"], t["b"]),
    "add(mul) fp32 (fma?)": lambda t: t["f"] + t["g"] * t["h"],
    "bf16 chain (a*b+c)*a": lambda t: (t["a"] * t["b"] + t["c"]) * t["a"],
    "rmsnorm scale (x*r).bf16*w": lambda t: (t["a"].float() * t["r"]).type_as(t["a"]) * t["w"],
    "rmsnorm x^2": lambda t: t["a"].float().pow(2),
    "rope": lambda t: rope(t["a"], t["cos"], t["sin"]),
    "swiglu silu(a)*b": lambda t: F.silu(t["a"]) * t["b"],
    "cast+cat (bucket copy-in)": lambda t: torch.cat([t["f"][:64].to(torch.bfloat16).flatten(), t["h"][:64].to(torch.bfloat16).flatten()]),
}


def timed(fn, t, iters=20) -> float:
    fn(t)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(t)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch._inductor.config as ic
    from titan.runtime.kernels.fusion import exact_config

    exact = exact_config()
    print(f"torch {torch.__version__}; exact settings present here: {exact}")
    print("lite mode options:", hasattr(ic, "fallback_by_default"), "eager_numerics:", hasattr(ic, "eager_numerics"))
    t = inputs()
    rows = []
    for name, fn in CASES.items():
        ref = fn(t)
        row = {"case": name, "eager_ms": timed(fn, t)}
        for label, patch in (("exact", exact), ("default", {})):
            torch._dynamo.reset()
            with ic.patch(patch):
                comp = torch.compile(fn, fullgraph=True)
                try:
                    out = comp(t)
                    row[f"{label}_equal"] = bool(torch.equal(out, ref))
                    row[f"{label}_maxdiff"] = float((out.float() - ref.float()).abs().max())
                    row[f"{label}_ms"] = timed(comp, t)
                except Exception as e:  # report and go on
                    row[f"{label}_equal"] = None
                    row[f"{label}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'case':32} {'eager ms':>9} {'exact ms':>9} {'exact==':>8} {'default ms':>10} {'default==':>9}")
    for r in rows:
        print(f"{r['case']:32} {r['eager_ms']:9.3f} {r.get('exact_ms', float('nan')):9.3f} "
              f"{str(r.get('exact_equal')):>8} {r.get('default_ms', float('nan')):10.3f} {str(r.get('default_equal')):>9}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"torch": torch.__version__, "exact_config": exact, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
