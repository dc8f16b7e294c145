"""The global expert load of one MoE layer's step: what every rank routed, summed."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def global_load(tokens_per_expert: torch.Tensor, dropped: torch.Tensor,
                load_groups: tuple[dist.ProcessGroup, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens per expert, dropped assignments) summed over every rank that routes its own
    tokens: `load_groups` are summed one after the other (integer sums: exact in any order)."""
    counts = torch.cat([tokens_per_expert, dropped.view(1)])
    for group in load_groups:
        counts = funcol.all_reduce(counts, "sum", group)
    return counts[:-1], counts[-1]
