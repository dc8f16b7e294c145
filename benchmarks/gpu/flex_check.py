"""FlexAttention's fused kernels on one GPU (issue 31), for benchmarks/gpu/gpu_flex.sh.

    python benchmarks/gpu/flex_check.py documents OUT --vocab V --eos E [--tokens N] [--shortest 64] [--longest 4096]
        a token file (and its titan-data sidecar) of random documents, lengths uniform in
        [shortest, longest], each followed by E: the data of the flex rows
    python benchmarks/gpu/flex_check.py ops
        titan::flex_attention on CUDA (runtime/kernels/flex_kernels.py) checked against:
        1. the block mask torch's create_block_mask makes for the same document mask (equal?);
        2. the dense reference (the op's CPU kernel, run on the GPU in float32 on the same
           inputs): largest difference, forward and gradients;
        3. torch's flex_attention compiled (torch.compile, as torchtitan runs it) with that block
           mask: bitwise equal?
        4. a CUDA graph captured once and replayed with new boundaries: equal to eager calls?
        then times forward + backward at Llama-3 1B's attention shape (seq 8192): flex document,
        flex causal, SDPA causal (flash).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def write_documents(out: Path, *, vocab: int, eos: int, tokens: int, shortest: int, longest: int) -> None:
    import numpy as np

    g = torch.Generator().manual_seed(31)
    parts, total = [], 0
    while total < tokens:
        n = int(torch.randint(shortest, longest + 1, (1,), generator=g))
        parts += [torch.randint(0, eos, (n,), generator=g), torch.tensor([eos])]
        total += n + 1
    dtype = "uint16" if vocab <= 65536 else "uint32"
    out.write_bytes(torch.cat(parts).numpy().astype(getattr(np, dtype)).tobytes())
    Path(str(out) + ".json").write_text(json.dumps({"format": "titan-tokens", "format_version": 1, "dtype": dtype,
                                                   "vocab_size": vocab, "tokens": total, "eos_id": eos}))
    print(f"{out}: {total} tokens in {len(parts) // 2} documents of {shortest}-{longest} tokens, separator {eos}")


def documents_of(batch: int, seq: int, mean: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    ends = (torch.rand(batch, seq, generator=g, device=device) < 1.0 / mean).long()
    return torch.cumsum(ends, dim=1) - ends


def _doc_mask_mod(documents):
    def mask(b, h, m, n):
        return (n <= m) & (documents[b, m] == documents[b, n])
    return mask


def check_ops() -> int:
    import titan.runtime.contract.flex_attention as op
    from titan.runtime.kernels.flex_block_mask import block_mask_tensors
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    dev = torch.device("cuda")
    B, H, S, D = 2, 4, 1024, 64
    docs = documents_of(B, S, 200, 0, dev)
    failures = 0

    ours = block_mask_tensors(docs, batch=B, seq=S, device=dev)
    theirs = create_block_mask(_doc_mask_mod(docs), B, None, S, S, device=dev)
    names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
             "full_q_num_blocks", "full_q_indices")
    same = [torch.equal(a, getattr(theirs, n)) for a, n in zip(ours, names)]
    print(f"1. block mask equal to create_block_mask's: {'yes' if all(same) else 'NO'} "
          f"({', '.join(n for n, s in zip(names, same) if not s) or 'all eight tensors'})")
    failures += not all(same)

    g = torch.Generator(device=dev).manual_seed(1)
    q, k, v, gout = (torch.randn(B, H, S, D, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    out = op.flex_attention(q, k, v, docs)
    grads = torch.autograd.grad(out, (q, k, v), gout)
    q32, k32, v32 = (t.detach().float() for t in (q, k, v))
    dense, lse = op._flex_attention(q32, k32, v32, docs)
    dense_grads = op._flex_attention_backward(gout.float(), q32, k32, v32, dense, lse, docs)
    worst = [(a.float() - b).abs().max().item() for a, b in zip((out, *grads), (dense, *dense_grads))]
    ok = all(w < 3e-2 for w in worst)
    print(f"2. against the dense reference (float32 of the same bf16 inputs), largest |difference| out / dq / dk / "
          f"dv: {' / '.join(f'{w:.2e}' for w in worst)}: {'within' if ok else 'BEYOND'} 3e-2")
    failures += not ok

    compiled = torch.compile(flex_attention)
    tq, tk, tv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    tout = compiled(tq, tk, tv, block_mask=theirs)
    tgrads = torch.autograd.grad(tout, (tq, tk, tv), gout)
    equal = [torch.equal(a, b) for a, b in zip((out, *grads), (tout, *tgrads))]
    print(f"3. torch.compile(flex_attention) with create_block_mask, bitwise out / dq / dk / dv: "
          f"{' / '.join('yes' if e else 'no' for e in equal)}"
          + ("" if all(equal) else f" (largest |difference| "
             f"{max((a - b).abs().max().item() for a, b in zip((out, *grads), (tout, *tgrads))):.2e})"))

    static_docs = docs.clone()
    sq, sk, sv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))

    def step():
        o = op.flex_attention(sq, sk, sv, static_docs)
        return (o, *torch.autograd.grad(o, (sq, sk, sv), gout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    replays = []
    for seed in (11, 12, 13):
        new = documents_of(B, S, 150, seed, dev)
        static_docs.copy_(new)
        graph.replay()
        eager_q, eager_k, eager_v = (t.detach().clone().requires_grad_(True) for t in (sq, sk, sv))
        o = op.flex_attention(eager_q, eager_k, eager_v, new)
        expected = (o, *torch.autograd.grad(o, (eager_q, eager_k, eager_v), gout))
        replays.append(all(torch.equal(a, b) for a, b in zip(captured, expected)))
    print(f"4. CUDA graph captured once, replayed with 3 new boundary sets, bitwise equal to eager calls: "
          f"{' / '.join('yes' if r else 'NO' for r in replays)}")
    failures += not all(replays)

    B, H, S, D = 1, 32, 8192, 64
    q, k, v, gout = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
    docs = documents_of(B, S, 2000, 5, dev)

    def timed(f, n=10):
        for _ in range(2):
            f()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e3

    def fwd_bwd(attend):
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        o = attend(qq, kk, vv)
        torch.autograd.grad(o, (qq, kk, vv), gout)

    sdpa = lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True)  # noqa: E731
    rows = [("flex document (mean 2000 tokens)", lambda a, b, c: op.flex_attention(a, b, c, docs)),
            ("flex causal", lambda a, b, c: op.flex_attention(a, b, c, None)),
            ("sdpa causal", sdpa)]
    print(f"5. forward + backward, (batch, heads, seq, dim) = {(B, H, S, D)} bf16, ms:")
    for name, attend in rows:
        print(f"   {name:<34} {timed(lambda: fwd_bwd(attend)):8.2f}")
    return 1 if failures else 0


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="what", required=True)
    d = sub.add_parser("documents")
    d.add_argument("out", type=Path)
    d.add_argument("--vocab", type=int, required=True)
    d.add_argument("--eos", type=int, required=True)
    d.add_argument("--tokens", type=int, default=1 << 20)
    d.add_argument("--shortest", type=int, default=64)
    d.add_argument("--longest", type=int, default=4096)
    sub.add_parser("ops")
    a = p.parse_args()
    if a.what == "documents":
        write_documents(a.out, vocab=a.vocab, eos=a.eos, tokens=a.tokens, shortest=a.shortest, longest=a.longest)
        return 0
    if not torch.cuda.is_available():
        print("flex_check ops: no GPU here (skipped)")
        return 0
    return check_ops()


if __name__ == "__main__":
    sys.exit(main())
