"""Gradients summed over a step's micro-batches into each parameter's .grad: what autograd's
AccumulateGrad does, in the same order, for a whole-model program (runtime/train.py) and for a
pipeline stage (runtime/pipeline_stage.py) alike."""

from __future__ import annotations

import torch


def accumulate_grads(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Set each parameter's .grad to its gradient (the first micro-batch), in the parameter's
    layout as autograd stores a first gradient (the parameters are contiguous), or add to it."""
    for p, g in zip(params, grads):
        if p.grad is None:
            p.grad = g if g.is_contiguous() else g.contiguous()
        else:
            p.grad.add_(g)
