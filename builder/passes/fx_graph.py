"""Generic FX graph tools the passes share: where a node came from (its module), node order
(moves, a stable topological sort with groups kept together) and inserting a node
whose fake value is computed from its inputs'.

Nothing here knows about collectives or about a model: those live in collectives.py and the
model's spec.
"""

from __future__ import annotations

import heapq

import torch
import torch.fx as fx


def module_path(node: fx.Node) -> str:
    return str((node.meta.get("custom") or {}).get("module", ""))


def move_after(anchor: fx.Node, nodes: list[fx.Node]) -> None:
    """Place `nodes`, in the given order, right after `anchor`."""
    for n in reversed(nodes):
        anchor.append(n)


def hoist_ancestors(nodes: list[fx.Node], before: fx.Node) -> None:
    """Move the non-placeholder ancestors of `nodes` (all after `before`) that sit after
    `before` to just before it, keeping their relative order (each after its own inputs).
    Walks only the stretch from `before` to the last of `nodes`, so callers stay linear."""
    left = set(nodes)
    stretch: dict[fx.Node, int] = {}
    n = before.next
    while left:
        assert n.op != "root", "hoist_ancestors: a node is not after `before`"
        stretch[n] = len(stretch)
        left.discard(n)
        n = n.next
    moved: set[fx.Node] = set()
    for node in nodes:  # one at a time, as separate calls would move them
        late: set[fx.Node] = set()
        stack = list(node.all_input_nodes)
        while stack:
            n = stack.pop()
            if n in late or n in moved or n.op == "placeholder" or n not in stretch:
                continue
            late.add(n)
            stack.extend(n.all_input_nodes)
        for n in sorted(late, key=stretch.__getitem__):
            before.prepend(n)
        moved |= late


def unit_graph(graph: fx.Graph, together: dict[fx.Node, int]):
    """The graph with each group of `together` contracted into one unit: (members of each unit
    in graph order, successors of each unit). A node outside groups is the unit ("node",
    position); group i is ("group", i)."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    unit = {n: ("group", together[n]) if n in together else ("node", pos[n]) for n in graph.nodes}
    members: dict[tuple, list[fx.Node]] = {}
    for n in graph.nodes:
        members.setdefault(unit[n], []).append(n)
    succs: dict[tuple, set] = {u: set() for u in members}
    for n in graph.nodes:
        for a in n.all_input_nodes:
            if unit[a] != unit[n]:
                succs[unit[a]].add(unit[n])
    return members, succs


def stable_toposort(graph: fx.Graph, *, together: dict[fx.Node, int] | None = None) -> None:
    """Reorder so that every node follows its inputs, otherwise keeping the current order as
    closely as possible (among ready units, the earliest goes first). Nodes that `together`
    maps to one group form one unit: emitted consecutively, in their current order, once all
    their outside inputs are (the group must be convex)."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    members, succs = unit_graph(graph, together or {})
    missing = dict.fromkeys(members, 0)
    for targets in succs.values():
        for u in targets:
            missing[u] += 1
    first = {u: pos[m[0]] for u, m in members.items()}
    ready = [(first[u], u) for u in members if missing[u] == 0]
    heapq.heapify(ready)
    order: list[fx.Node] = []
    while ready:
        _, u = heapq.heappop(ready)
        order += members[u]
        for s in succs[u]:
            missing[s] -= 1
            if missing[s] == 0:
                heapq.heappush(ready, (first[s], s))
    assert len(order) == len(nodes), "graph has a cycle (or a group that is not convex)"
    if order == nodes:
        return
    output = order[-1]
    assert output.op == "output"
    for n in order[:-1]:
        output.prepend(n)


def emit(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None, *,
         like: fx.Node | None = None) -> fx.Node:
    """Insert a call of `target` (at the graph's current insertion point) with meta['val']
    computed by running it on the argument nodes' fake values, and provenance from `like`."""
    from torch._guards import detect_fake_mode

    vals = fx.node.map_arg(args, lambda a: a.meta["val"])
    flat = [v for v in torch.utils._pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)]
    mode = detect_fake_mode(flat)
    assert mode is not None, "passes run on traced graphs whose values are fake tensors"
    with mode:
        val = target(*vals, **(kwargs or {}))
    n = graph.call_function(target, args, kwargs)
    n.meta["val"] = val
    if like is not None and "custom" in like.meta:
        n.meta["custom"] = dict(like.meta["custom"])
    return n
