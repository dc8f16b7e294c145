"""The learning-rate schedule: linear warmup, a stable phase, then a decay to a minimum factor.

torchtitan's warmup-stable-decay shape: `warmup_steps` of linear warmup, `decay_ratio` of the
steps at the end decaying (linear, cosine, 1-sqrt; or none), the steps between at the peak.
`factor(done)` is the multiplier of the peak LR for the optimizer step taken after `done`
steps: the function torch.optim.lr_scheduler.LambdaLR is given in the eager reference
(cli/tools/verify.py), so both compute each step's LR as the same Python float,
`lr * factor(done)`. The position in the schedule is the optimizer's step count, which every
checkpoint holds: a resumed run continues the schedule exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY_TYPES = ("none", "linear", "cosine", "sqrt")


@dataclass(frozen=True, kw_only=True)
class LRSchedule:
    lr: float
    """Peak learning rate."""
    warmup_steps: int
    """Steps of linear warmup: step k (from 1) runs at k / warmup_steps of the peak."""
    stable_steps: int
    """Steps at the peak after warmup."""
    decay_steps: int
    """Steps of decay at the end."""
    decay_type: str
    """none, linear, cosine or sqrt (1 - sqrt)."""
    min_lr_factor: float
    """Where the decay is headed: the fraction of the peak it would reach one step after the end."""

    @staticmethod
    def for_run(*, lr: float, steps: int, warmup_steps: int, decay_type: str, decay_ratio: float | None,
                min_lr_factor: float) -> LRSchedule:
        """The schedule of a run of `steps` optimizer steps; ValueError (naming the fix) for one
        that does not fit."""
        if decay_type not in DECAY_TYPES:
            raise ValueError(f"--decay-type {decay_type!r}: use one of {', '.join(DECAY_TYPES)}")
        if warmup_steps > steps:
            raise ValueError(f"--warmup-steps {warmup_steps} is more than --steps {steps}; warm up over fewer steps")
        if decay_type == "none":
            decay = 0
        elif decay_ratio is None:
            decay = steps - warmup_steps
        else:
            decay = round(steps * decay_ratio)
            if warmup_steps + decay > steps:
                raise ValueError(f"--decay-ratio {decay_ratio} decays over {decay} steps, which with --warmup-steps "
                                 f"{warmup_steps} is more than --steps {steps}; lower one of them")
        return LRSchedule(lr=lr, warmup_steps=warmup_steps, stable_steps=steps - warmup_steps - decay,
                          decay_steps=decay, decay_type=decay_type, min_lr_factor=min_lr_factor)

    def factor(self, done: int) -> float:
        """The peak LR's multiplier for the step after `done` optimizer steps."""
        if done < self.warmup_steps:
            return (done + 1) / self.warmup_steps
        into_decay = done - self.warmup_steps - self.stable_steps
        if self.decay_type == "none" or into_decay < 0:
            return 1.0
        progress = into_decay / self.decay_steps  # 0 at the first decay step, below 1 at the last
        if self.decay_type == "linear":
            left = 1.0 - progress
        elif self.decay_type == "sqrt":
            left = 1.0 - math.sqrt(progress)
        else:
            left = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_factor + (1.0 - self.min_lr_factor) * left

    def lr_at(self, done: int) -> float:
        """The LR of the step after `done` optimizer steps (as LambdaLR computes it)."""
        return self.lr * self.factor(done)

    def as_dict(self) -> dict:
        """What decides each step's LR (recorded in checkpoints; a resume compares it). Without a
        decay, the number of steps does not: a resume may train longer at the same LR."""
        shape = {"lr": self.lr, "warmup_steps": self.warmup_steps, "decay_type": self.decay_type}
        if self.decay_type != "none":
            shape.update(stable_steps=self.stable_steps, decay_steps=self.decay_steps, min_lr_factor=self.min_lr_factor)
        return shape
