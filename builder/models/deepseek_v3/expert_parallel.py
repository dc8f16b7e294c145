"""Lay a DeepSeekV3 module's routed experts out over expert-parallel ranks.

The `ep` ranks are carved from the data-parallel ranks (as torchtitan does): each routes its
own tokens, holds n_routed_experts / ep of every MoE layer's experts (a contiguous run, so
expert e lives on rank e // experts_per_rank) and exchanges tokens with its peers through the
static-buffer dispatch. Everything outside the routed experts stays data parallel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from titan.builder.models.deepseek_v3.dispatch import DispatchPlan, make_plan
from titan.builder.models.deepseek_v3.model import DeepSeekV3

EXPERT_WEIGHTS = ("w1", "w2", "w3")


def set_dispatch(model: DeepSeekV3, *, tokens: int, ep: int = 1, ep_group: dist.ProcessGroup | None = None,
                 load_group: dist.ProcessGroup | None = None,
                 capacity_factor: float | None = None) -> DispatchPlan:
    """Give every MoE layer its static dispatch plan for `tokens` routed per rank per step.

    ep_group: the expert-parallel peers (None when ep == 1); load_group: every data-parallel
    rank sharing the balancing bias (None on a single rank).
    """
    cfg = model.cfg
    plan = make_plan(n_experts=cfg.n_routed_experts, ep=ep, tokens=tokens, top_k=cfg.top_k,
                     capacity_factor=capacity_factor)
    for moe in model.moe_layers():
        moe.plan, moe.ep_group, moe.load_group = plan, ep_group, load_group
    return plan


def shard_experts(model: DeepSeekV3, *, ep: int, ep_rank: int) -> None:
    """Keep only this rank's experts of every MoE layer (their parameters are replaced)."""
    for moe in model.moe_layers():
        for name in EXPERT_WEIGHTS:
            full = getattr(moe, name)
            per_rank = full.shape[0] // ep
            local = full.detach().narrow(0, ep_rank * per_rank, per_rank)
            setattr(moe, name, nn.Parameter(local.clone() if local.device.type != "meta" else torch.empty_like(local)))


def is_expert_param(fqn: str) -> bool:
    """Whether a parameter is a routed expert's (sharded over ep, not data-parallel reduced over it)."""
    # The stacked expert weights are the model's only parameters not named "<module>.weight".
    return fqn.rsplit(".", 1)[-1] in EXPERT_WEIGHTS
