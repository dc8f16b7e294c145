"""The compute-dtype copies of the parameters that a program's forward takes instead of the
parameters (GraphInput.cast; builder/passes/param_casts.py moved their casts out of the graph),
and the gradients its backward gives for those copies.

A copy is the cast the forward used to make at every step: `param.to(dtype)`. It is made when
the parameters are (seeded, loaded or resumed: `refresh`), and after each optimizer step the
optimizer writes it as it writes the parameter (runtime/optim.py, runtime/fused_adamw.py), with
the same rounding. Each copy keeps its address, as a captured forward needs.

The backward gives the copy's gradient (bf16) where the parameter's (fp32) was only its exact
upcast. A captured step hands it to the update as it is, as the copy's .grad (the parameter's
.grad stays None), and the one-kernel AdamW and the gradient norm read it in bf16 and upcast
as they read: one pass over the gradients fewer per step, the same bits. Everywhere else
(micro-batches summed, the eager step) it is upcast into the parameter's .grad at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from titan.runtime.contract.rank_record import GraphInput

if TYPE_CHECKING:
    import torch.fx as fx

    from titan.runtime.contract.rank_record import RankRecord


class ParamCopies:
    """Per parameter (in the program's parameter order): its copy, or None where the forward
    takes the parameter itself; and whether the backward gives the copy's gradient."""

    def __init__(self, inputs: tuple[GraphInput, ...], params: list[torch.Tensor],
                 grad_dtypes: list[torch.dtype] | None = None):
        """`grad_dtypes`: per parameter, the dtype of the gradient the backward returns for it
        (None: each parameter's own)."""
        casts = [inp.cast for inp in inputs if inp.kind == "param"]
        assert len(casts) == len(params), "one forward input per parameter"
        self.copies: list[torch.Tensor | None] = [
            None if cast is None else torch.empty_like(p, dtype=getattr(torch, cast))
            for p, cast in zip(params, casts)]
        grad_dtypes = grad_dtypes or [p.dtype for p in params]
        self.low_grads = [c is not None and dtype == c.dtype for c, dtype in zip(self.copies, grad_dtypes)]
        """Per parameter: the backward returns its copy's gradient (in the copy's dtype)."""
        self.params = params
        self.refresh()

    def __bool__(self) -> bool:
        return any(c is not None for c in self.copies)

    @torch.no_grad()
    def refresh(self) -> None:
        """Each copy made again from its parameter (after the parameters changed other than by
        the optimizer: a resumed checkpoint)."""
        for p, copy in zip(self.params, self.copies):
            if copy is not None:
                copy.copy_(p)

    def forward_values(self) -> list[torch.Tensor]:
        """What the forward takes for each parameter: its copy, or the parameter."""
        return [p if copy is None else copy for p, copy in zip(self.params, self.copies)]


def param_grad_dtypes(record: RankRecord, backward: fx.GraphModule) -> list[torch.dtype]:
    """Per parameter, the dtype of the gradient `backward` returns for it (its own, or its
    copy's: the record's checks allow only those)."""
    outputs = next(n for n in backward.graph.nodes if n.op == "output").args[0]
    return [getattr(torch, out.meta["titan_val"]["dtype"])
            for inp, out in zip(record.forward_inputs, outputs) if inp.kind == "param"]


def gradients(params: list[torch.Tensor], copies: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Each parameter's gradient as the step left it: its .grad, else its copy's (a captured
    step's, in the copy's dtype: its upcast is the parameter's gradient). For a reader that
    upcasts as it reads (runtime/captured_update.py)."""
    return [p.grad if p.grad is not None or c is None else c.grad for p, c in zip(params, copies)]


@torch.no_grad()
def upcast_gradients(params: list[torch.Tensor], copies: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Each parameter's gradient in its .grad, in its dtype: a copy's gradient a captured step
    left is upcast (exactly) into the parameter's .grad. For the op-by-op update, which scales
    and reads .grad in the parameter's dtype."""
    for p, c in zip(params, copies):
        if p.grad is None and c is not None and c.grad is not None:
            p.grad, c.grad = c.grad.to(p.dtype), None
    return [p.grad for p in params]
