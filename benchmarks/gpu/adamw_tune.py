"""The one-kernel AdamW's launch shape (runtime/fused_adamw.py) on one GPU: every BLOCK x
num_warps candidate timed over Llama 3 1B's parameters (one rank, fp32) and checked bitwise
against the shipped configuration (an elementwise kernel: its shape must not change a bit), beside
the memory-bound floor of the same traffic (a copy moving the bytes the update reads and writes).

    python benchmarks/gpu/adamw_tune.py [--reps 10]

Prints one line per candidate: ms per step, TB/s of the update's traffic (4 reads + 3 writes of
fp32 per element), and whether it equals the shipped configuration bit for bit.
"""

from __future__ import annotations

import argparse

import torch

from titan.runtime import fused_adamw


def llama_1b_shapes() -> list[tuple[int, ...]]:
    dim, ffn, kv, vocab, layers = 2048, 8192, 512, 128256, 16
    per_layer = [(dim, dim), (kv, dim), (kv, dim), (dim, dim), (ffn, dim), (dim, ffn), (ffn, dim), (dim,), (dim,)]
    return [(vocab, dim)] + per_layer * layers + [(dim,), (vocab, dim)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = llama_1b_shapes()
    params0 = [torch.randn(s, device=dev, generator=gen) * 0.02 for s in shapes]
    grads = [torch.randn(s, device=dev, generator=gen) * 1e-3 for s in shapes]
    scale = torch.tensor([0.5], device=dev)
    n = sum(p.numel() for p in params0)
    traffic = 7 * 4 * n
    kernel = fused_adamw._build_kernel()

    def run(block: int, warps: int, scaled: bool):
        opt = fused_adamw.FusedAdamW([p.clone() for p in params0], lr=8e-4, betas=(0.9, 0.95), eps=1e-8,
                                     weight_decay=0.1)
        for p, g in zip(opt.params, grads):
            p.grad = g
        opt.prepare()

        def step():
            for p, m, v in zip(opt.params, opt.exp_avg, opt.exp_avg_sq):
                k = p.numel()
                kernel[((k + block - 1) // block,)](p, p.grad, m, v, k, opt.scalars, scale if scaled else opt.scalars,
                                                    SCALE_GRAD=scaled, BLOCK=block, num_warps=warps,
                                                    enable_fp_fusion=False)
        step()  # compile, and the state after one step (the bitwise check)
        state = [t.clone() for t in (*opt.params, *opt.exp_avg, *opt.exp_avg_sq)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.reps):
            step()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / args.reps
        del opt
        return ms, state

    print(f"{len(shapes)} tensors, {n / 1e9:.3f}e9 fp32 elements, {traffic / 1e9:.1f} GB per step; "
          f"shipped BLOCK {fused_adamw.BLOCK}, num_warps {fused_adamw.NUM_WARPS}", flush=True)
    src = torch.empty(traffic // 2 // 4, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.reps):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    floor = start.elapsed_time(end) / args.reps
    print(f"copy of the same bytes: {floor:.2f} ms ({traffic / floor / 1e9:.2f} TB/s)", flush=True)
    del src, dst
    for scaled in (False, True):
        _, shipped = run(fused_adamw.BLOCK, fused_adamw.NUM_WARPS, scaled)
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                ms, state = run(block, warps, scaled)
                same = all(torch.equal(a, b) for a, b in zip(state, shipped))
                print(f"scaled={int(scaled)} BLOCK {block:5d} num_warps {warps:2d}: {ms:6.2f} ms "
                      f"{traffic / ms / 1e9:5.2f} TB/s  bitwise {'yes' if same else 'NO'}", flush=True)
                del state
        del shipped
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
