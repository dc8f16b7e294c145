"""A pipeline stage run from its program's graphs (builder/trace/stage_trace.py): the
StageRunner of runtime/pipeline_executor.py. Per micro-batch, the forward's saved activations are
held until that micro-batch's backward; each backward adds its parameter gradients to the
parameters' .grad (set on the first), as autograd accumulates them. A zero-bubble schedule runs
each backward in two (backward_input, then backward_weight): the stored backward graph cut by
runtime/backward_split.py, the values the weight part reads held in between."""

from __future__ import annotations

import functools

import torch
import torch.fx as fx

from titan.runtime.backward_split import SplitBackward, split_backward
from titan.runtime.grad_accumulation import accumulate_grads


class GraphStage:
    def __init__(self, *, forward: fx.GraphModule, backward: fx.GraphModule, params: list[torch.Tensor],
                 inputs: tuple[str, ...], tokens: tuple[torch.Tensor, ...], labels: tuple[torch.Tensor, ...],
                 activation_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None = None):
        """`params` in the program's order; `inputs` its input kinds (STAGE_INPUTS); `tokens` and
        `labels` this step's micro-batches (used by the first and last stage); received
        activations and gradients land in buffers of `activation_shape` and `dtype` on `device`."""
        self.fw, self.bw, self.params, self.inputs = forward, backward, params, inputs
        self.tokens, self.labels = tokens, labels
        self.activation_shape, self.dtype, self.device = activation_shape, dtype, device
        self.saved: dict[int, list[torch.Tensor]] = {}
        self.losses: dict[int, torch.Tensor] = {}
        """The last stage's loss of each micro-batch."""
        self.last = "labels" in inputs
        self.held: dict[int, tuple[torch.Tensor, ...]] = {}
        """Per micro-batch between its backward_input and backward_weight: what the weight part reads."""

    def forward(self, microbatch: int, inputs: torch.Tensor | None) -> torch.Tensor | None:
        values = {"tokens": lambda: self.tokens[microbatch], "activations": lambda: inputs,
                  "labels": lambda: self.labels[microbatch]}
        with torch.no_grad():
            out, *saved = self.fw(*self.params, *(values[kind]() for kind in self.inputs))
        self.saved[microbatch] = saved
        if self.last:
            self.losses[microbatch] = out
            return None
        return out

    def backward(self, microbatch: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        saved = self.saved.pop(microbatch)
        if grad_output is None:  # the last stage: the gradient of its loss
            grad_output = torch.ones_like(self.losses[microbatch])
        with torch.no_grad():
            grads = self.bw(*saved, grad_output)
            accumulate_grads(self.params, grads)
        input_grads = grads[len(self.params):]
        return input_grads[self.inputs.index("activations")] if "activations" in self.inputs else None

    @functools.cached_property
    def split(self) -> SplitBackward:
        """The backward's input- and weight-gradient parts, cut on first use."""
        return split_backward(self.bw, n_params=len(self.params))

    def backward_input(self, microbatch: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """The input-gradient part of the backward: returns the gradient of the stage's input (None
        on the first stage); the parameters' gradients wait for backward_weight."""
        saved = self.saved.pop(microbatch)
        if grad_output is None:  # the last stage: the gradient of its loss
            grad_output = torch.ones_like(self.losses[microbatch])
        with torch.no_grad():
            out = self.split.input(*saved, grad_output)
        self.held[microbatch] = tuple(out[self.split.n_input_grads:])
        input_grads = out[:self.split.n_input_grads]
        return input_grads[self.inputs.index("activations")] if "activations" in self.inputs else None

    def backward_weight(self, microbatch: int) -> None:
        """The weight-gradient part: adds the parameters' gradients, as backward does."""
        with torch.no_grad():
            accumulate_grads(self.params, self.split.weight(*self.held.pop(microbatch)))

    def input_buffer(self, microbatch: int) -> torch.Tensor:
        return torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)

    def output_grad_buffer(self, microbatch: int) -> torch.Tensor:
        return torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)
