"""Lay a model's routed experts out over expert-parallel ranks (the MoE families' place_rank).

The `ep` ranks are carved from the data-parallel ranks (as torchtitan does): each routes its
own tokens, holds n_experts / ep of every MoE layer's experts (a contiguous run, so expert e
lives on rank e // experts_per_rank) and exchanges tokens with its peers through the
static-buffer dispatch. Everything outside the routed experts stays data parallel.

The model lists its MoE layers with `moe_layers()` (see builder/models/moe/__init__.py for
what a layer holds).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from titan.builder.models.moe import EXPERT_WEIGHTS, is_expert_param
from titan.builder.models.moe.dispatch import DispatchPlan, make_plan
from titan.builder.models.spec import RankPlace

__all__ = ["is_expert_param", "place_rank", "set_dispatch", "shard_experts"]


def set_dispatch(model: nn.Module, *, tokens: int, ep: int = 1, ep_group: dist.ProcessGroup | None = None,
                 load_groups: tuple[dist.ProcessGroup, ...] = (), capacity_factor: float | None = None,
                 tp_group: dist.ProcessGroup | None = None) -> DispatchPlan:
    """Give every MoE layer its static dispatch plan for `tokens` routed per rank per step.

    ep_group: the expert-parallel peers (None when ep == 1); load_groups: groups whose sums,
    taken one after the other, add up every rank that routes its own tokens (and, where the
    family has one, shares the balancing bias); none on a single rank. tp_group: under expert
    tensor parallelism, the ranks that split every expert's hidden width (expert_tp.py).
    """
    layers = model.moe_layers()
    first = layers[0]
    plan = make_plan(n_experts=first.n_experts, ep=ep, tokens=tokens, top_k=first.top_k,
                     capacity_factor=capacity_factor)
    for moe in layers:
        assert (moe.n_experts, moe.top_k) == (first.n_experts, first.top_k), "one plan fits every MoE layer"
        moe.plan, moe.ep_group, moe.load_groups, moe.tp_group = plan, ep_group, load_groups, tp_group
    return plan


def place_rank(model: nn.Module, place: RankPlace) -> dict | None:
    """The ModelSpec hook: every rank routes its own tokens (its sequence shard under tp), sends
    them to the experts' ranks over `ep` and sums the expert load over every mesh dimension (all
    ranks route distinct tokens; a pipeline stage's mesh has no pp dimension: each stage sums its
    own layers' load). Under expert tensor parallelism (the config's `etp` > 1) the tp ranks route
    the whole sequence alike, so the load is summed over every dimension but tp. Returns the
    dispatch plan, the same on every rank; None for a pipeline stage that holds no MoE block
    (DeepSeek-V3's dense first blocks)."""
    if not model.moe_layers():
        return None
    layout, mesh = place.layout, place.mesh
    names = mesh.mesh_dim_names if mesh is not None else ()
    expert_tp = getattr(model.cfg, "etp", 1) > 1
    routing_dims = tuple(name for name in names if not (expert_tp and name == "tp"))
    plan = set_dispatch(model, tokens=place.batch_size * place.seq_len // (1 if expert_tp else layout.tp),
                        ep=layout.ep, ep_group=mesh.get_group("ep") if "ep" in names else None,
                        load_groups=tuple(mesh.get_group(name) for name in routing_dims),
                        capacity_factor=place.capacity_factor,
                        tp_group=mesh.get_group("tp") if expert_tp else None)
    # The capacity factor and expert TP only when set: other builds' records stay what they were.
    factor = {} if place.capacity_factor is None else {"capacity_factor": place.capacity_factor}
    etp = {"expert_tp": layout.tp} if expert_tp else {}
    # Named as blocks (`layers.4`): a pipeline stage's programs relabeled to another stage's
    # blocks (builder/program/stage_relabel.py) then name that stage's MoE blocks.
    return {"moe_layers": [f"layers.{i}" for i, block in model.layers.items() if block.moe],
            "routed_experts": plan.n_experts, "ep": plan.ep, "experts_per_rank": plan.experts_per_rank,
            "top_k": plan.top_k, "tokens_per_rank": plan.tokens, "capacity": plan.capacity,
            "buffer_rows": plan.buffer_rows, "dropless": plan.dropless, **factor, **etp}


def shard_experts(model: nn.Module, *, ep: int, ep_rank: int) -> None:
    """Keep only this rank's experts of every MoE layer (their parameters are replaced)."""
    for moe in model.moe_layers():
        for name in EXPERT_WEIGHTS:
            full = getattr(moe, name)
            per_rank = full.shape[0] // ep
            local = full.detach().narrow(0, ep_rank * per_rank, per_rank)
            setattr(moe, name, nn.Parameter(local.clone() if local.device.type != "meta" else torch.empty_like(local)))
