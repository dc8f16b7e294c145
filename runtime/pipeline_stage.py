"""A pipeline stage run from its program's graphs (builder/trace/stage_trace.py): the
StageRunner of runtime/pipeline_executor.py. Per micro-batch, the forward's saved activations are
held until that micro-batch's backward; each backward adds its parameter gradients to the
parameters' .grad (set on the first), as autograd accumulates them. A zero-bubble schedule runs
each backward in two (backward_input, then backward_weight): the stored backward graph cut by
runtime/backward_split.py, the values the weight part reads held in between. With a dropless
redo (runtime/moe_redo.py), a forward whose bounded dispatch overflowed is run again by the
dropless program, and that micro-batch's backward is the dropless program's."""

from __future__ import annotations

import functools

import torch
import torch.fx as fx

from titan.runtime.backward_split import SplitBackward, split_backward
from titan.runtime.grad_accumulation import accumulate_grads
from titan.runtime.moe_redo import OverflowRedo


class GraphStage:
    def __init__(self, *, forward: fx.GraphModule, backward: fx.GraphModule, params: list[torch.Tensor],
                 inputs: tuple[str, ...], tokens: tuple[torch.Tensor, ...], labels: tuple[torch.Tensor, ...],
                 activation_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None = None,
                 buffers: list[torch.Tensor] = (), updated: list[torch.Tensor] = (),
                 redo: OverflowRedo | None = None):
        """`params` in the program's order; `inputs` its input kinds (STAGE_INPUTS); `tokens` and
        `labels` this step's micro-batches (used by the first and last stage); received
        activations and gradients land in buffers of `activation_shape` and `dtype` on `device`.
        `buffers`: the model buffers the forward reads, after the parameters (a MoE's balancing
        bias and load); `updated`: those whose new values the forward returns first, in that order;
        `redo`: the stage's dropless redo of an overflowing bounded forward."""
        self.fw, self.bw, self.params, self.inputs = forward, backward, params, inputs
        self.redo = redo
        self.redone: set[int] = set()
        """The micro-batches in flight whose forward was redone dropless (their backward is the redo's)."""
        self.buffers, self.updated = list(buffers), list(updated)
        self.tokens, self.labels = tokens, labels
        self.activation_shape, self.dtype, self.device = activation_shape, dtype, device
        self.saved: dict[int, list[torch.Tensor]] = {}
        self.losses: dict[int, torch.Tensor] = {}
        """The last stage's loss of each micro-batch."""
        self.last = "labels" in inputs
        self.held: dict[int, tuple[torch.Tensor, ...]] = {}
        """Per micro-batch between its backward_input and backward_weight: what the weight part reads."""
        # Where the received activations' gradient is among the backward's input gradients (one
        # per forward input after the parameters: None for each buffer).
        self.input_grad = len(self.buffers) + inputs.index("activations") if "activations" in inputs else None

    def forward(self, microbatch: int, inputs: torch.Tensor | None) -> torch.Tensor | None:
        values = {"tokens": lambda: self.tokens[microbatch], "activations": lambda: inputs,
                  "labels": lambda: self.labels[microbatch]}
        args = [*self.params, *self.buffers, *(values[kind]() for kind in self.inputs)]
        with torch.no_grad():
            outputs = self.fw(*args)
            if self.redo is not None and self.redo.overflowed(self.redo.overflow_count(outputs)):
                # Nothing of the bounded attempt was applied yet (its buffer updates come below).
                del outputs
                outputs = self.redo.forward(*args)
                self.redone.add(microbatch)
        del args
        n = len(self.updated)
        out, *saved = outputs[n:]
        self._update_buffers(outputs[:n], saved)
        self.saved[microbatch] = saved
        if self.last:
            self.losses[microbatch] = out
            return None
        return out

    def _update_buffers(self, updates, saved: list[torch.Tensor]) -> None:
        """A forward's buffer updates take effect at once, as eager PyTorch's in-place updates do:
        the stage's next micro-batch reads them (a pipeline runs several forwards before their
        backwards). This micro-batch's backward may still recompute from the old values
        (activation checkpointing saves the buffers themselves), so what it saved of them is
        kept as it was."""
        if not self.updated:
            return
        storages = {b.untyped_storage().data_ptr() for b in self.updated}
        for i, t in enumerate(saved):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in storages:
                saved[i] = t.clone()
        for buffer, new in zip(self.updated, updates, strict=True):
            buffer.copy_(new)

    def backward(self, microbatch: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        saved = self.saved.pop(microbatch)
        if grad_output is None:  # the last stage: the gradient of its loss
            grad_output = torch.ones_like(self.losses[microbatch])
        redone = microbatch in self.redone
        self.redone.discard(microbatch)
        with torch.no_grad():
            grads = (self.redo.backward if redone else self.bw)(*saved, grad_output)
            accumulate_grads(self.params, grads)
        return None if self.input_grad is None else grads[len(self.params) + self.input_grad]

    @functools.cached_property
    def split(self) -> SplitBackward:
        """The backward's input- and weight-gradient parts, cut on first use."""
        return split_backward(self.bw, n_params=len(self.params))

    @functools.cached_property
    def redo_split(self) -> SplitBackward:
        """The dropless redo backward's parts, cut on first use."""
        return split_backward(self.redo.backward, n_params=len(self.params))

    def backward_input(self, microbatch: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """The input-gradient part of the backward: returns the gradient of the stage's input (None
        on the first stage); the parameters' gradients wait for backward_weight."""
        saved = self.saved.pop(microbatch)
        if grad_output is None:  # the last stage: the gradient of its loss
            grad_output = torch.ones_like(self.losses[microbatch])
        split = self.redo_split if microbatch in self.redone else self.split  # kept until backward_weight
        with torch.no_grad():
            out = split.input(*saved, grad_output)
        self.held[microbatch] = tuple(out[split.n_input_grads:])
        return None if self.input_grad is None else out[self.input_grad]

    def backward_weight(self, microbatch: int) -> None:
        """The weight-gradient part: adds the parameters' gradients, as backward does."""
        split = self.redo_split if microbatch in self.redone else self.split
        self.redone.discard(microbatch)
        with torch.no_grad():
            accumulate_grads(self.params, split.weight(*self.held.pop(microbatch)))

    def input_buffer(self, microbatch: int) -> torch.Tensor:
        return torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)

    def output_grad_buffer(self, microbatch: int) -> torch.Tensor:
        return torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)
