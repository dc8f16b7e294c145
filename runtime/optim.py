"""AdamW for the runtime.

torch.optim imports torch._dynamo on first use, which the runtime must not; and a later CUDA
graph capture wants the update as plain tensor ops. This is the same arithmetic, op for op, as
torch.optim.AdamW's single-tensor path (foreach=False), so the two are bitwise equal; the eager
reference uses torch.optim.AdamW(foreach=False) and tests hold the equality.

The learning rate follows `schedule` (runtime/lr_schedule.py) when one is given: each step's LR
is the Python float `schedule.lr_at(steps taken)`, the value torch.optim.lr_scheduler.LambdaLR
gives torch's AdamW for the same step, so the two stay bitwise equal under any schedule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from titan.runtime.param_copies import upcast_gradients

if TYPE_CHECKING:
    from titan.runtime.lr_schedule import LRSchedule


class AdamW:
    def __init__(self, params: list[torch.Tensor], *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, schedule: LRSchedule | None = None,
                 copies: list[torch.Tensor | None] | None = None):
        """`copies`: per parameter, its compute-dtype copy that the forward takes (or None):
        each step writes it from the updated parameter (runtime/param_copies.py)."""
        self.params = list(params)
        self.copies = list(copies) if copies is not None else [None] * len(self.params)
        assert len(self.copies) == len(self.params), "one copy (or None) per parameter"
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.schedule = schedule
        self.exp_avg = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]
        self.steps = 0

    def next_step(self) -> tuple[float, float]:
        """Count one more step (setting .lr to the schedule's); its (step_size,
        bias_correction2_sqrt), as torch computes them."""
        if self.schedule is not None:
            self.lr = self.schedule.lr_at(self.steps)
        self.steps += 1
        beta1, beta2 = self.betas
        step = float(self.steps)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        return self.lr / bias_correction1, bias_correction2 ** 0.5

    @torch.no_grad()
    def step(self) -> None:
        step_size, bias_correction2_sqrt = self.next_step()
        beta1, beta2 = self.betas
        grads = upcast_gradients(self.params, self.copies)
        for p, grad, exp_avg, exp_avg_sq in zip(self.params, grads, self.exp_avg, self.exp_avg_sq):
            assert grad is not None, "every parameter gets a gradient from the backward graph"
            p.mul_(1 - self.lr * self.weight_decay)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
            p.addcdiv_(exp_avg, denom, value=-step_size)
        for p, copy in zip(self.params, self.copies):
            if copy is not None:
                copy.copy_(p)  # the cast the forward used to make from the updated parameter

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, copy in zip(self.params, self.copies):
            p.grad = None
            if copy is not None:
                copy.grad = None
