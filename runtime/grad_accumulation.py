"""Gradients summed over a step's micro-batches into each parameter's .grad: what autograd's
AccumulateGrad does, in the same order, for a whole-model program (runtime/train.py) and for a
pipeline stage (runtime/pipeline_stage.py) alike."""

from __future__ import annotations

import torch


def accumulate_grads(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Set each parameter's .grad to its gradient (the first micro-batch), in the parameter's
    layout as autograd stores a first gradient (the parameters are contiguous), or add to it.
    A gradient of the parameter's compute-dtype copy (runtime/param_copies.py) is upcast: the
    exact value the graph's own cast gave (and add_ upcasts it as it adds, rounding once in
    fp32 as the sum of the cast would)."""
    for p, g in zip(params, grads):
        if p.grad is None:
            p.grad = g.to(p.dtype, memory_format=torch.contiguous_format)
        else:
            p.grad.add_(g)
