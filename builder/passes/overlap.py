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

from titan.builder.passes.collectives import ALL_GATHER, Collective, collectives
from titan.builder.passes.fx_graph import move_after
from titan.builder.passes.registry import PassContext


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


def _window_before(start: fx.Node, stop) -> list[fx.Node]:
    """The nodes between the last node before `start` for which stop(node) holds (exclusive)
    and `start`, in graph order; walks back only that far, so the pass stays linear."""
    window = []
    n = start.prev
    while n.op != "root" and not stop(n):
        window.append(n)
        n = n.prev
    window.reverse()
    return window


def _issue_early(colls: list[Collective], fsdp_gathers: set[fx.Node]) -> None:
    marks = {c.start for c in colls} | {c.wait for c in colls}
    previous_gather: Collective | None = None
    for c in colls:
        if c.start in fsdp_gathers:
            boundary = previous_gather.wait if previous_gather is not None else None
            previous_gather = c
            window = _window_before(c.start, lambda n, b=boundary: n is b)
            if boundary is not None and (not window or window[0].prev is not boundary):
                continue  # the previous gather's wait is not before this start: nothing moves
        else:
            window = _window_before(c.start, marks.__contains__)
        window = [n for n in window if n.op != "placeholder"]
        needed = _ancestors_within(c.start, set(window))
        move_after(c.start, [n for n in window if n not in needed])


def _wait_late(colls: list[Collective]) -> None:
    starts_of = {c.start: c.group for c in colls}
    for c in colls:
        users = set(c.wait.users)
        # Never past the next collective on the same process group: a same-group start
        # already sits between this start and its wait, or the walk stops at the next one.
        n = c.start.next
        while n is not c.wait and starts_of.get(n) != c.group:
            n = n.next
        if n is not c.wait:
            continue
        n = c.wait.next
        while n.op != "root" and n not in users and starts_of.get(n) != c.group:
            n = n.next
        if n.op != "root" and n is not c.wait.next:
            n.prepend(c.wait)


def overlap_collectives_pass(gm: fx.GraphModule, *, ctx: PassContext) -> fx.GraphModule:
    colls = collectives(gm.graph)
    fsdp_gathers = {c.start for c in colls
                    if c.start.target is ALL_GATHER and ctx.mesh_dims.get(c.group) == "dp_shard"}
    _issue_early(colls, fsdp_gathers)
    _wait_late(colls)
    gm.graph.lint()
    gm.recompile()
    return gm
