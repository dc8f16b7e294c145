"""The compute-dtype copies of the parameters that a program's forward takes instead of the
parameters (GraphInput.cast; builder/passes/param_casts.py moved their casts out of the graph).

A copy is the cast the forward used to make at every step: `param.to(dtype)`. It is made when
the parameters are (seeded, loaded or resumed: `refresh`), and after each optimizer step the
optimizer writes it as it writes the parameter (runtime/optim.py, runtime/fused_adamw.py), with
the same rounding. Each copy keeps its address, as a captured forward needs.
"""

from __future__ import annotations

import torch

from titan.runtime.contract.rank_record import GraphInput


class ParamCopies:
    """Per parameter (in the program's parameter order): its copy, or None where the forward
    takes the parameter itself."""

    def __init__(self, inputs: tuple[GraphInput, ...], params: list[torch.Tensor]):
        casts = [inp.cast for inp in inputs if inp.kind == "param"]
        assert len(casts) == len(params), "one forward input per parameter"
        self.copies: list[torch.Tensor | None] = [
            None if cast is None else torch.empty_like(p, dtype=getattr(torch, cast))
            for p, cast in zip(params, casts)]
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

    def forward_value(self, index: int) -> torch.Tensor:
        """What the forward takes for parameter `index`."""
        copy = self.copies[index]
        return self.params[index] if copy is None else copy
