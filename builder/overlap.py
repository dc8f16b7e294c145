"""Collective overlap: order nodes so that collectives run while independent compute does.

Only the node order changes, never what a node computes, so results are bit for bit those of
the unscheduled graph. Two moves, in this order:

1. Issue early. Each collective start moves up to the end of the previous collective's
   region: the compute between that point and the start which the collective does not
   depend on moves to just after the start (where it now overlaps with it). Tensor-parallel
   collectives thus overlap with, e.g., the weight-gradient matmuls the backward had placed
   before them. FSDP all-gathers instead move up to the previous FSDP all-gather's wait:
   block k+1's parameters are gathered while block k computes (one block of prefetch, so
   at most two gathered blocks are in flight).
2. Wait late. Each wait moves down to just before the first node that reads its result, but
   never past the next collective on the same process group: FSDP reduce-scatters of one
   block finish while the next block's backward runs, and at most one is outstanding (its
   fp32 input stays alive until the wait).

Every rank applies the same moves to graphs of the same structure, so all ranks still issue
their collectives in one order.
"""

from __future__ import annotations

import torch.fx as fx

from titan.builder.collectives import ALL_GATHER, Collective, collectives
from titan.builder.fx_graph import move_after, positions
from titan.builder.passes import PassContext


def _ancestors_within(node: fx.Node, window: set[fx.Node]) -> set[fx.Node]:
    found: set[fx.Node] = set()
    stack = [n for n in node.all_input_nodes if n in window]
    while stack:
        n = stack.pop()
        if n in found:
            continue
        found.add(n)
        stack.extend(m for m in n.all_input_nodes if m in window)
    return found


def _issue_early(graph: fx.Graph, colls: list[Collective], fsdp_gathers: set[fx.Node]) -> None:
    previous_gather: Collective | None = None
    for c in colls:
        nodes = list(graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        if c.start in fsdp_gathers:
            boundary = pos[previous_gather.wait] if previous_gather is not None else -1
            previous_gather = c
        else:
            marks = [pos[d.start] for d in colls if pos[d.start] < pos[c.start]]
            marks += [pos[d.wait] for d in colls if pos[d.wait] < pos[c.start]]
            boundary = max(marks, default=-1)
        window = [n for n in nodes[boundary + 1:pos[c.start]] if n.op != "placeholder"]
        needed = _ancestors_within(c.start, set(window))
        move_after(c.start, [n for n in window if n not in needed])


def _wait_late(graph: fx.Graph, colls: list[Collective]) -> None:
    for c in colls:
        pos = positions(graph)
        nodes = list(graph.nodes)
        limit = min(pos[u] for u in c.wait.users)
        later_same_group = [pos[d.start] for d in colls if d.group == c.group and pos[d.start] > pos[c.start]]
        limit = min([limit, *later_same_group])
        if limit > pos[c.wait] + 1:
            nodes[limit].prepend(c.wait)


def overlap_collectives_pass(gm: fx.GraphModule, *, ctx: PassContext) -> fx.GraphModule:
    colls = collectives(gm.graph)
    fsdp_gathers = {c.start for c in colls
                    if c.start.target is ALL_GATHER and ctx.mesh_dims.get(c.group) == "dp_shard"}
    _issue_early(gm.graph, colls, fsdp_gathers)
    _wait_late(gm.graph, colls)
    gm.graph.lint()
    gm.recompile()
    return gm
