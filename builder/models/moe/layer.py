"""The parts of a mixture-of-experts layer every family builds the same way (the contract the
package docstring names): the router and the stacked expert weights, and the dispatch state
that titan-build sets and titan-run's metrics read."""

from __future__ import annotations

import torch
from torch import nn


def add_router_and_experts(layer: nn.Module, *, experts: int, dim: int, hidden: int) -> None:
    """`gate` (dim -> experts) and the stacked SwiGLU weights `w1`, `w2`, `w3`."""
    layer.gate = nn.Linear(dim, experts, bias=False)
    # Stacked expert weights, (experts, out, in) like nn.Linear's, so a slice on dim 0 is one
    # rank's experts.
    layer.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
    layer.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
    layer.w3 = nn.Parameter(torch.empty(experts, hidden, dim))


def add_dispatch_state(layer: nn.Module, *, experts: int) -> None:
    """The load buffers each forward writes (tokens_per_expert, dropped_tokens), and the static
    dispatch plan and process groups titan-build sets (expert_parallel.py)."""
    layer.register_buffer("tokens_per_expert", torch.zeros(experts, dtype=torch.int64))
    layer.register_buffer("dropped_tokens", torch.zeros((), dtype=torch.int64))
    layer.plan = None
    layer.ep_group = None
    layer.load_groups = ()
