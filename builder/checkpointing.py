"""Activation checkpointing as a graph policy: recompute tags on the joint graph, which the
partitioner honours (tagged forward nodes are recomputed in the backward instead of saved).

- none: no tags; the min-cut partitioner alone decides what to save.
- full: every forward node of a transformer block is recomputed, its collectives included
  (so FSDP parameters are gathered again in the backward: reshard after forward). Only the
  residual stream at block boundaries is saved.
- selective: as full, but the outputs of matmuls, attention and tensor-parallel
  reduce-scatters are saved (the expensive ones); the cheap elementwise work is recomputed.

Recomputation runs the same ops on the same inputs, so results are unchanged.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

import titan.runtime.ops  # noqa: F401  (registers torch.ops.titan)
from titan.builder.collectives import REDUCE_SCATTER, WAIT, module_path
from titan.builder.passes import AC_POLICIES

_SAVED_IN_SELECTIVE = {torch.ops.aten.mm.default, torch.ops.titan.attention.default, REDUCE_SCATTER}


def _backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that depend on the tangent of the loss."""
    tangents = [n for n in graph.nodes if n.op == "placeholder" and type(n.meta.get("desc")).__name__ == "TangentAOTInput"]
    assert tangents, "joint graph without a tangent input"
    seen: set[fx.Node] = set()
    stack = list(tangents)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.users)
    return seen


def _expensive(n: fx.Node) -> bool:
    """A matmul, attention or reduce-scatter, or the wait / tuple item that yields its result."""
    if n.target in (WAIT, operator.getitem):
        n = n.args[0]
    return n.target in _SAVED_IN_SELECTIVE


def tag_activation_checkpointing(joint: fx.GraphModule, policy: str) -> int:
    """Tag the joint graph for `policy`; returns the number of nodes marked for recompute."""
    assert policy in AC_POLICIES, policy
    if policy == "none":
        return 0
    backward = _backward_nodes(joint.graph)
    tagged = 0
    for n in joint.graph.nodes:
        if n.op != "call_function" or n in backward:
            continue
        parts = module_path(n).split(".")
        if parts[0] != "layers" or len(parts) < 2:
            continue
        save = policy == "selective" and _expensive(n)
        n.meta["recompute"] = CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
        n.meta["ac_graph_id"] = int(parts[1])
        tagged += not save
    return tagged
