"""titan's AdamW is bitwise torch.optim.AdamW (single-tensor path) with the same settings."""

from __future__ import annotations

import torch

from titan.runtime.optim import AdamW
from titan.runtime.recipe import adamw_options
from titan.runtime.run_config import RunConfig

ADAMW = adamw_options(RunConfig())


def test_adamw_matches_torch_bitwise_over_steps():
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32,), (7, 3, 5)]
    ours = [torch.randn(s, generator=g) for s in shapes]
    theirs = [p.clone() for p in ours]
    opt_ours = AdamW(ours, lr=1e-3, **ADAMW)
    opt_theirs = torch.optim.AdamW(theirs, lr=1e-3, foreach=False, **ADAMW)
    for _ in range(12):
        grads = [torch.randn(s, generator=g) for s in shapes]
        for p, q, gr in zip(ours, theirs, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        opt_ours.step()
        opt_theirs.step()
        opt_ours.zero_grad()
        opt_theirs.zero_grad()
        for p, q in zip(ours, theirs):
            assert torch.equal(p, q)
    for i, q in enumerate(theirs):
        assert torch.equal(opt_ours.exp_avg[i], opt_theirs.state[q]["exp_avg"])
        assert torch.equal(opt_ours.exp_avg_sq[i], opt_theirs.state[q]["exp_avg_sq"])


def test_adamw_writes_each_copy_as_the_forward_cast_it():
    """The compute-dtype copies the forward takes (runtime/param_copies.py) are after each step
    what the cast in the forward made of the updated parameter, at every magnitude."""
    g = torch.Generator().manual_seed(1)
    shapes = [(64, 32), (32,), (7, 3, 5)]
    params = [torch.randn(s, generator=g) * torch.exp2(torch.randint(-140, 10, s, generator=g).float())
              for s in shapes]
    copies = [torch.empty_like(params[0], dtype=torch.bfloat16), None, torch.empty_like(params[2], dtype=torch.float16)]
    opt = AdamW(params, lr=1e-3, copies=copies, **ADAMW)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        for p, copy in zip(params, copies):
            assert copy is None or torch.equal(copy, p.to(copy.dtype))
