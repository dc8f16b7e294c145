"""A model's buffers as training state: state that the forward updates in place outside the
gradient (a mixture of experts' balancing bias and its per-step expert load).

The artifact lists them (rank metadata `buffers`: name, shape, dtype, the metric each feeds)
and which of the forward's first outputs is each one's new value (`mutated_buffers`). They
start at zero, go into checkpoints, and take their new values only after the backward: with
activation checkpointing the backward recomputes the forward from the old values, which it
holds as saved inputs aliasing the buffers themselves.

Their element types and metric names are checked when the record is read
(runtime/contract/rank_record.py). Metrics are read after the step (one host transfer, after the optimizer step), never inside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from titan.runtime.contract.rank_record import BufferSpec, RankRecord


class BufferState:
    """This rank's buffers, by name, in the order the metadata lists them."""

    def __init__(self, *records: RankRecord, device: torch.device,
                 load: Callable[[BufferSpec], torch.Tensor | None] = lambda spec: None):
        """The buffers of `records` (a rank's program, or each of its pipeline stages' programs,
        whose blocks and so buffers differ); `load`: a buffer's initial value (e.g. from a
        Hugging Face checkpoint), None for zeros."""
        self.specs = tuple(b for record in records for b in record.buffers)
        self.tensors = {}
        for b in self.specs:
            loaded = load(b)
            self.tensors[b.fqn] = (torch.zeros(b.shape, dtype=getattr(torch, b.dtype), device=device)
                                   if loaded is None else loaded)
        self.mutated = [fqn for record in records for fqn in record.mutated_buffers]

    def __len__(self) -> int:
        return len(self.tensors)

    def copy_back(self, updates: list[torch.Tensor]) -> None:
        """The forward's new values (its first outputs), in place: a captured step keeps reading
        the same tensors."""
        for fqn, value in zip(self.mutated, updates, strict=True):
            self.tensors[fqn].copy_(value)

    def metrics(self) -> dict[str, float]:
        """The step's expert load from the buffers that feed metrics: the largest and the mean
        tokens per expert (over every MoE layer: the mean is the same in each) and the tokens
        dropped for capacity (summed over layers). Empty for a model without such buffers."""
        loads = [self.tensors[b.fqn] for b in self.specs if b.metric == "tokens_per_expert"]
        dropped = [self.tensors[b.fqn] for b in self.specs if b.metric == "dropped_tokens"]
        if not loads and not dropped:
            return {}
        # Reduced on the device and read in one transfer (one wait on the stream per step).
        values = []
        if loads:
            stacked = torch.stack(loads).double()
            values += [stacked.max(), stacked.mean()]
        if dropped:
            values.append(torch.stack(dropped).double().sum())
        read = torch.stack(values).tolist()
        out = {}
        if loads:
            out["expert_load_max"], out["expert_load_mean"] = read[0], read[1]
        if dropped:
            out["dropped_tokens"] = int(read[-1])
        return out
