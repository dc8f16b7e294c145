"""The parts of a mixture-of-experts layer every family builds the same way (the contract the
package docstring names): the router and the stacked expert weights, and the dispatch state
that titan-build sets and titan-run's metrics read."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from titan.builder.models.moe.dispatch import DispatchResult, dispatch_and_combine
from titan.builder.models.moe.expert_tp import gather_sequence, local_experts, sum_sequence_shards


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
    dispatch plan and process groups titan-build sets (expert_parallel.py): `tp_group` only
    under expert tensor parallelism (expert_tp.py)."""
    layer.register_buffer("tokens_per_expert", torch.zeros(experts, dtype=torch.int64))
    layer.register_buffer("dropped_tokens", torch.zeros((), dtype=torch.int64))
    layer.plan = None
    layer.ep_group = None
    layer.load_groups = ()
    layer.tp_group = None


Router = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(tokens, dim) -> (expert ids, routing weights), each (tokens, top_k)."""


def run_routed_experts(layer: nn.Module, x: torch.Tensor, route: Router) -> tuple[torch.Tensor, DispatchResult]:
    """The routed experts' output for x ((batch, seq, dim), this rank's sequence shard under tp),
    in x's shape and dtype, and the dispatch's counts. Under expert TP the tp ranks route the
    gathered sequence alike and each runs its hidden slice of the experts (expert_tp.py)."""
    assert layer.plan is not None, "set the MoE layer's plan (the static dispatch sizes) before running the model"
    tokens = gather_sequence(x, layer.tp_group)
    flat = tokens.flatten(0, -2)
    expert_ids, weights = route(flat)
    routed = dispatch_and_combine(flat, expert_ids, weights, plan=layer.plan, **local_experts(layer),
                                  group=layer.ep_group)
    return sum_sequence_shards(routed.out.to(x.dtype).view(tokens.shape), layer.tp_group), routed
