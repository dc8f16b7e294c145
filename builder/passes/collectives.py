"""Functional collectives in a traced graph: the ops, and each start paired with its wait.

A collective in these graphs is a start node (`_c10d_functional.all_gather_into_tensor`,
`reduce_scatter_tensor`, `all_reduce`) whose one user is a `wait_tensor`. At run time the
start issues the collective on the process group's stream (which first waits for the work
already queued on the compute stream) and the wait makes the compute stream wait for its
result. Node order is therefore schedule: what sits between a start and its wait overlaps
with the collective. Moving nodes never changes what any node computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

c10d = torch.ops._c10d_functional
ALL_GATHER = c10d.all_gather_into_tensor.default
REDUCE_SCATTER = c10d.reduce_scatter_tensor.default
ALL_REDUCE = c10d.all_reduce.default
WAIT = c10d.wait_tensor.default
STARTS = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE)


@dataclass(frozen=True)
class Collective:
    start: fx.Node
    """The node that issues the collective."""
    wait: fx.Node
    """Its wait_tensor."""

    @property
    def group(self) -> str:
        """Process-group name (the last positional argument of every start op)."""
        return self.start.args[-1]


def collectives(graph: fx.Graph) -> list[Collective]:
    """Every collective of the graph, in node order."""
    out = []
    for n in graph.nodes:
        if n.op == "call_function" and n.target in STARTS:
            waits = [u for u in n.users if u.target is WAIT]
            assert len(waits) == 1 and len(n.users) == 1, f"{n} should have exactly one user, its wait"
            out.append(Collective(n, waits[0]))
    return out
