"""A pipeline stage run from its program's graphs (builder/trace/stage_trace.py): the
StageRunner of runtime/pipeline_executor.py. Per micro-batch, the forward's saved activations are
held until that micro-batch's backward; each backward adds its parameter gradients to the
parameters' .grad (set on the first), as autograd accumulates them. A zero-bubble schedule runs
each backward in two (backward_input, then backward_weight): the stored backward graph cut by
runtime/backward_split.py, the values the weight part reads held in between.

With `gathered` (runtime/stage_gather.py, titan-run's default), what the parameters alone
determine (their all-gathers, casts and copies) is computed once per step, before the stage's first
forward, and held until its last backward; the graphs run are then the gather's compute parts,
which take those values first. With `reduced` (runtime/stage_reduce.py, opt-in: numerics change)
the backward's reduce-scatters wait for the step's last micro-batch: each backward's unsharded
gradient buckets are summed, and reduced once after the last. With a dropless redo
(runtime/moe_redo.py), a forward whose bounded dispatch overflowed is run again by the dropless
program, and that micro-batch's backward is the dropless program's (such a stage runs its stored
graphs: runtime/pipeline_program.py gives it neither `gathered` nor `reduced`)."""

from __future__ import annotations

import functools

import torch
import torch.fx as fx

from titan.runtime.backward_split import SplitBackward, split_backward
from titan.runtime.grad_accumulation import accumulate_grads
from titan.runtime.moe_redo import OverflowRedo
from titan.runtime.stage_gather import StageGather
from titan.runtime.stage_reduce import StageReduce


class GraphStage:
    def __init__(self, *, forward: fx.GraphModule, backward: fx.GraphModule, params: list[torch.Tensor],
                 inputs: tuple[str, ...], tokens: tuple[torch.Tensor, ...], labels: tuple[torch.Tensor, ...],
                 activation_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None = None,
                 buffers: list[torch.Tensor] = (), updated: list[torch.Tensor] = (),
                 gathered: StageGather | None = None, reduced: StageReduce | None = None,
                 redo: OverflowRedo | None = None):
        """`params` in the program's order; `inputs` its input kinds (STAGE_INPUTS); `tokens` and
        `labels` this step's micro-batches (used by the first and last stage); received
        activations and gradients land in buffers of `activation_shape` and `dtype` on `device`.
        `buffers`: the model buffers the forward reads, after the parameters (a MoE's balancing
        bias and load); `updated`: those whose new values the forward returns first, in that order.
        `gathered`: the graphs cut by stage_gather.gather_once (then `forward` and `backward` are
        its parts), to gather once per step; `reduced`: the backward cut by
        stage_reduce.reduce_once (then `backward` is its compute part), to reduce once per step;
        `redo`: the stage's dropless redo of an overflowing bounded forward (with neither of those:
        the redo's graphs take the parameters as the stored ones do)."""
        assert redo is None or (gathered is None and reduced is None), "a redo stage runs its stored graphs"
        self.fw, self.bw, self.params, self.inputs = forward, backward, params, inputs
        self.redo = redo
        self.redone: set[int] = set()
        """The micro-batches in flight whose forward was redone dropless (their backward is the redo's)."""
        self.gathered = gathered
        self.values: tuple[torch.Tensor, ...] | None = None
        """With `gathered`: this step's gathered values, from the first forward to the last backward."""
        self.backwards_done = 0
        self.reduced = reduced
        self.n_partials = 0 if reduced is None else reduced.n_partials
        self.partials: list[torch.Tensor] | None = None
        """With `reduced`: this step's unsharded gradient buckets, summed over its micro-batches so far."""
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
        args = [*self._values(), *self.params, *self.buffers, *(values[kind]() for kind in self.inputs)]
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

    def _values(self) -> tuple[torch.Tensor, ...]:
        """The gathered values the graphs read first (none without `gathered`), gathered on the
        step's first call."""
        if self.gathered is None:
            return ()
        if self.values is None:
            with torch.no_grad():
                self.values = tuple(self.gathered.gather(*self.params))
        return self.values

    def _add_grads(self, outputs) -> None:
        """Add a micro-batch's parameter gradients (and, with `reduced`, its partials: summed in
        micro-batch order) from the backward's first outputs."""
        partials, grads = outputs[:self.n_partials], outputs[self.n_partials:self.n_partials + len(self.params)]
        if self.n_partials and self.partials is None:
            # Own copies: a partial a graph returns may share memory with what else it returns.
            self.partials = [p.clone(memory_format=torch.contiguous_format) for p in partials]
        elif self.n_partials:
            for total, p in zip(self.partials, partials):
                total.add_(p)
        self._accumulate(grads)

    def _accumulate(self, grads) -> None:
        """Add each given gradient (None: given by the other part) to its parameter's .grad."""
        given = [(p, g) for p, g in zip(self.params, grads) if g is not None]
        accumulate_grads([p for p, _ in given], [g for _, g in given])

    def _backward_done(self) -> None:
        """After each micro-batch's last backward part: the step's last lets the gathered values go
        and reduces the summed partials (every stage of a step sees the step's micro-batches as
        `tokens`)."""
        self.backwards_done += 1
        if self.backwards_done == len(self.tokens):
            self.values, self.backwards_done = None, 0
            if self.reduced is not None:
                self._accumulate(self.reduced.reduce(*self.partials))
                self.partials = None

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
            grads = (self.redo.backward if redone else self.bw)(*self._values(), *saved, grad_output)
            self._add_grads(grads)
            self._backward_done()
        return None if self.input_grad is None else grads[self.n_partials + len(self.params) + self.input_grad]

    @functools.cached_property
    def split(self) -> SplitBackward:
        """The backward's input- and weight-gradient parts, cut on first use."""
        return split_backward(self.bw, n_params=self.n_partials + len(self.params))

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
            out = split.input(*self._values(), *saved, grad_output)
        self.held[microbatch] = tuple(out[split.n_input_grads:])
        return None if self.input_grad is None else out[self.input_grad]

    def backward_weight(self, microbatch: int) -> None:
        """The weight-gradient part: adds the parameters' gradients, as backward does."""
        split = self.redo_split if microbatch in self.redone else self.split
        self.redone.discard(microbatch)
        with torch.no_grad():
            self._add_grads(split.weight(*self.held.pop(microbatch)))
            self._backward_done()

    def input_buffer(self, microbatch: int) -> torch.Tensor:
        return torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)

    def output_grad_buffer(self, microbatch: int) -> torch.Tensor:
        return torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)
