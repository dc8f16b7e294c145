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
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch.fx as fx

AC_POLICIES = ("none", "full", "selective")
"""titan-build --ac. This module imports torch only when it tags a graph: titan-build checks the
policy on the cache-hit path."""


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


def _expensive_ops() -> set:
    """What selective saves: matmuls, attention and tensor-parallel reduce-scatters."""
    import torch

    import titan.runtime.contract.ops  # noqa: F401  (registers torch.ops.titan)
    from titan.builder.passes.collectives import REDUCE_SCATTER

    return {torch.ops.aten.mm.default, torch.ops.titan.attention.default, torch.ops.titan.flex_attention.default,
            REDUCE_SCATTER}


def _expensive(n: fx.Node, expensive_ops: set) -> bool:
    """One of `expensive_ops`, or the wait / tuple item that yields its result."""
    from titan.builder.passes.collectives import WAIT

    if n.target in (WAIT, operator.getitem):
        n = n.args[0]
    return n.target in expensive_ops


def tag_activation_checkpointing(joint: fx.GraphModule, policy: str, *, ac_block: Callable[[str], int | None]) -> int:
    """Tag the joint graph for `policy`; returns the number of nodes marked for recompute.
    `ac_block(module)` is the block a module belongs to, recomputed as one unit (the model spec's)."""
    from torch.utils.checkpoint import CheckpointPolicy

    from titan.builder.passes.fx_graph import module_path

    assert policy in AC_POLICIES, policy
    if policy == "none":
        return 0
    backward = _backward_nodes(joint.graph)
    expensive_ops = _expensive_ops()
    tagged = 0
    for n in joint.graph.nodes:
        if n.op != "call_function" or n in backward:
            continue
        block = ac_block(module_path(n))
        if block is None:
            continue
        save = policy == "selective" and _expensive(n, expensive_ops)
        n.meta["recompute"] = CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
        n.meta["ac_graph_id"] = block
        tagged += not save
    return tagged
