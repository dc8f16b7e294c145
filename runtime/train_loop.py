"""The optimizer-step loop, shared by titan-run and the eager reference of titan-verify, so that
both take every step the same way: the step's micro-batches (forward + backward each, the
gradients summed), the update (the global gradient norm, the clip, the optimizer step with the
LR from the schedule), the bookkeeping.

A step function trains one micro-batch: `step_fn(tokens, labels)` adds the micro-batch's
gradients to each parameter's .grad (setting it on the first) and returns its loss, already
divided by the number of micro-batches (runtime/recipe.py). A pipeline schedule is another
such function over the same micro-batches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from titan.runtime.distributed import dp_sum


@dataclass
class StepResults:
    """Per optimizer step: the loss summed over data-parallel ranks (the global batch's mean
    token loss) and the global gradient norm before clipping (None without a norm function)."""
    losses: list[torch.Tensor] = field(default_factory=list)
    grad_norms: list[torch.Tensor | None] = field(default_factory=list)
    val_losses: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """(step, validation loss) after each step that validated."""


@dataclass
class Validation:
    """Held-out loss: the mean over `steps` batches of `data` (the same ones every time) of the
    loss summed over data-parallel ranks, each from `forward_loss` (forward only), after every
    `every` optimizer steps and the last."""
    forward_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    data: object
    steps: int
    every: int | None
    device: torch.device
    mesh: object

    def due(self, step: int, last: int) -> bool:
        return step == last or (self.every is not None and step % self.every == 0)

    def __call__(self) -> torch.Tensor:
        total = None
        for k in range(self.steps):
            tokens, labels = self.data.batch(k)
            loss = dp_sum(self.forward_loss(tokens.to(self.device), labels.to(self.device)), self.mesh)
            total = loss if total is None else total + loss
        return (total / self.steps).cpu()


def train_loop(step_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], optimizer,
               data, *, steps: int, device: torch.device, mesh, tokens_per_step: int,
               log: Callable[[dict], None] | None, start: int = 0, micro_batches: int = 1,
               update: Callable[[], torch.Tensor | None] | None = None,
               validation: Validation | None = None,
               after_step: Callable[[int], None] | None = None,
               step_metrics: Callable[[], dict] | None = None,
               pipeline_step: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], torch.Tensor] | None = None
               ) -> StepResults:
    """Run optimizer steps start+1 .. steps. Step s reads micro-batches (s-1)*n .. s*n-1 of
    `data`. `update()` applies the summed gradients and returns their global norm before any
    clip (None if it measures none); by default it is `optimizer.step()`; `validation` runs when due
    (its time is not in the step's); `after_step(step)` runs after
    each (checkpointing); `step_metrics()` adds to the logged record (read after the step,
    e.g. the expert load from the model's buffers). `pipeline_step(batches)`, when given, runs
    the step's micro-batches together through a pipeline schedule instead of `step_fn` one by
    one, and returns the step's loss."""
    results = StepResults()
    for step in range(start + 1, steps + 1):
        batches = [data.batch((step - 1) * micro_batches + k) for k in range(micro_batches)]
        batches = [(tokens.to(device), labels.to(device)) for tokens, labels in batches]
        t0 = time.perf_counter()
        local = None
        if pipeline_step is not None:
            local = pipeline_step(batches)
        for tokens, labels in batches if pipeline_step is None else ():
            loss = step_fn(tokens, labels)
            local = loss if local is None else local + loss
        if update is not None:
            norm = update()
        else:
            norm = None
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = dp_sum(local, mesh)
        # One transfer (one wait on the device) for the step's numbers.
        loss, norm = torch.stack([loss, norm.to(loss.dtype)]).cpu() if norm is not None else (loss.cpu(), None)
        dt = time.perf_counter() - t0
        results.losses.append(loss)
        results.grad_norms.append(norm)
        val = None
        if validation is not None and validation.due(step, steps):
            val = validation()
            results.val_losses.append((step, val))
        if log is not None:
            # titan's AdamW holds its LR; torch's (the eager reference) in its parameter group.
            lr = optimizer.lr if hasattr(optimizer, "lr") else optimizer.param_groups[0]["lr"]
            record = {"step": step, "loss": loss.item(), "lr": lr,
                      "tokens_per_s": tokens_per_step * micro_batches / dt, "step_time_s": dt, "time": time.time()}
            if norm is not None:
                record["grad_norm"] = norm.item()
            if val is not None:
                record["val_loss"] = val.item()
            if device.type == "cuda":
                record["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            if step_metrics is not None:
                record.update(step_metrics())
            log(record)
        if after_step is not None:
            after_step(step)
    return results
