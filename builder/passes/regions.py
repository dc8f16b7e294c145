"""Fusion regions: exact element-wise regions (the default), and titan-build --fuse's RMSNorm,
RoPE, SwiGLU and loss regions or whole-block regions.

fuse_exact (default, numerics-preserving) groups only element-wise ops that inductor, under
runtime/kernels/fusion.py's exact settings, computes bit for bit as eager's kernels do (measured per op
on the GPU host by benchmarks/exact_ops.py; ops that measured different, and every reduction,
stay on eager kernels). The regions are tagged "exact#<n>".

fuse_regions and fuse_blocks (titan-build --fuse, opt-in) group all element-wise and reduction
work, per RMSNorm / RoPE / SwiGLU / loss module instance or per transformer block. Fused
kernels keep intermediates in registers and reduce in their own order, so results differ from
eager in the last bits: those passes are labeled as changing numerics.

Every pass orders the graph so that each region's nodes are consecutive and tags them
(node.meta["titan_region"] = "<kind>#<n>", written to the graph as the node's "region");
titan-run compiles each region into generated kernels on the device it trains on
(runtime/kernels/fusion.py). Matmuls, attention and collectives stay outside regions.

A region is a convex set of same-key nodes (no path leaves it and comes back), so that it can run
as one call: groups grow greedily in graph order (_convex_groups).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from titan.builder.passes.collectives import STARTS, WAIT
from titan.builder.passes.fx_graph import module_path, stable_toposort, unit_graph
from titan.builder.passes.registry import PassContext

aten = torch.ops.aten
# Left to their own libraries: matmuls (cuBLAS), attention (flash), collectives (NCCL).
_NOT_FUSED = {aten.mm.default, aten.bmm.default, aten.addmm.default, WAIT, *STARTS}
MIN_REGION_OPS = 2
LONE_CAST_MIN_ELEMENTS = 1 << 20
"""A dtype cast alone is a region from this many elements on: ATen's casting copy streamed at
0.9 TB/s (bf16 -> fp32 weight gradients) and 1.8 TB/s (fp32 -> bf16 parameters) on an H100 in
issue 30's profile, 13.5 ms of a 1B step at seq 8192, where a generated kernel streams near the
memory's bandwidth. A cast rounds once, so every kernel gives the same bits."""


# Element-wise ops whose fused kernels measured torch.equal to eager (benchmarks/exact_ops.py,
# H200, torch 2.11). Not here: reductions (their order differs), reciprocal, sigmoid and
# silu_backward (measured different), and everything not measured.
EXACT_OPS = {
    aten.mul.Tensor, aten.mul.Scalar, aten.add.Tensor, aten.sub.Tensor, aten.neg.default,
    aten.div.Tensor, aten.div.Scalar, aten.pow.Tensor_Scalar, aten.rsqrt.default, aten.silu.default,
    aten._to_copy.default, aten.clone.default, aten.cat.default, aten.stack.default, aten.where.self,
    aten.select_backward.default, aten.slice_backward.default,
}
_EXACT_POWERS = (1, 2, 3)


def exact_op(n: fx.Node) -> bool:
    """Whether fusing `n` keeps eager's bits: a listed op (or a view) with plain arguments."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return False
    returns = n.target._schema.returns
    if len(returns) != 1 or str(returns[0].type) != "Tensor":
        return False  # split and the like give lists: a region's results must be tensors
    if n.target.is_view and n.target.namespace == "aten":
        return True
    if n.target not in EXACT_OPS:
        return False
    if n.target in (aten.add.Tensor, aten.sub.Tensor) and n.kwargs.get("alpha", 1) != 1:
        return False  # eager may contract a + alpha * b into one FMA
    if n.target is aten.pow.Tensor_Scalar and n.args[1] not in _EXACT_POWERS:
        return False
    if n.target is aten._to_copy.default and not _plain_cast(n):
        return False  # a device, layout or memory-format change is not a fusable cast
    return True


def _plain_cast(n: fx.Node) -> bool:
    """A _to_copy that changes at most the dtype (naming the input's own layout and device is
    allowed: traced `.to(dtype)` and `.float()` calls often spell them out)."""
    src = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
    for k, v in n.kwargs.items():
        if k == "dtype":
            continue
        if k == "layout" and v == torch.strided:
            continue
        if k == "device" and src is not None and torch.device(v) == src.device:
            continue
        if k == "memory_format" and v in (None, torch.preserve_format):
            continue
        return False
    return True


def _fusable(n: fx.Node, tagged: dict[fx.Node, str]) -> bool:
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        return n.args[0] in tagged
    return isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "aten" and n.target not in _NOT_FUSED


class _Groups:
    """Convex groups of same-key nodes, grown greedily in graph order.

    A node joins the groups of its same-key inputs (merging them, when none depends on another)
    if none of its other inputs depends on those groups: then no path leaves a group and comes
    back, so each group can run as one call. Dependencies are bitsets of group ids."""

    def __init__(self) -> None:
        self.parent: list[int] = []
        self.mask: list[int] = []       # bits of the ids merged into each root
        self.deps: list[int] = []       # groups the members depend on, through any path
        self.members: list[list[fx.Node]] = []

    def find(self, g: int) -> int:
        while self.parent[g] != g:
            self.parent[g] = self.parent[self.parent[g]]
            g = self.parent[g]
        return g

    def new(self, n: fx.Node, deps: int) -> int:
        g = len(self.parent)
        self.parent.append(g)
        self.mask.append(1 << g)
        self.deps.append(deps)
        self.members.append([n])
        return g

    def independent(self, a: int, b: int) -> bool:
        return not (self.deps[a] & self.mask[b]) and not (self.deps[b] & self.mask[a])

    def merge(self, roots: list[int], n: fx.Node, deps: int) -> int:
        g = roots[0]
        for r in roots[1:]:
            self.parent[r] = g
            self.mask[g] |= self.mask[r]
            self.deps[g] |= self.deps[r]
            self.members[g] += self.members[r]
        self.deps[g] |= deps
        self.members[g].append(n)
        return g


def _convex_groups(graph: fx.Graph, key: dict[fx.Node, str]) -> list[list[fx.Node]]:
    groups = _Groups()
    group_of: dict[fx.Node, int] = {}   # raw id; groups.find() gives the group
    reach: dict[fx.Node, int] = {}      # groups a node's value depends on (its own included)
    for n in graph.nodes:
        inputs = list(dict.fromkeys(n.all_input_nodes))
        deps = 0
        for a in inputs:
            deps |= reach[a]
        chosen = None
        if n in key:
            candidates = list(dict.fromkeys(groups.find(group_of[a]) for a in inputs
                                            if a in group_of and key[a] == key[n]))
            merged: list[int] = []
            for c in candidates:
                if all(groups.independent(c, m) for m in merged):
                    merged.append(c)
            for option in ([merged] if len(merged) > 1 else []) + [[c] for c in candidates]:
                mask = 0
                for c in option:
                    mask |= groups.mask[c]
                outside = [a for a in inputs if a not in group_of or groups.find(group_of[a]) not in option]
                if all(not (reach[a] & mask) for a in outside):
                    chosen = groups.merge(option, n, deps)
                    break
            if chosen is None:
                chosen = groups.new(n, deps)
            group_of[n] = chosen
            deps |= 1 << chosen
        reach[n] = deps
    return [groups.members[r] for r in {groups.find(g) for g in group_of.values()}]


def _cyclic_groups(graph: fx.Graph, regions: list[list[fx.Node]]) -> list[int]:
    """Groups on cycles of units (each group run as one unit: two convex groups can each need the
    other's outputs); empty when the units can be ordered."""
    _, succs = unit_graph(graph, {n: i for i, r in enumerate(regions) for n in r})
    preds: dict = {u: set() for u in succs}
    for u, targets in succs.items():
        for v in targets:
            preds[v].add(u)
    # Peel units with no predecessor, then units with no successor, among those left: what
    # remains lies on cycles or between them.
    left = set(succs)
    for edges, other in ((preds, succs), (succs, preds)):
        count = {u: len(edges[u]) for u in left}
        todo = [u for u in left if count[u] == 0]
        while todo:
            u = todo.pop()
            left.discard(u)
            for v in other[u]:
                if v in left:
                    count[v] -= 1
                    if count[v] == 0:
                        todo.append(v)
    return [i for kind, i in left if kind == "group"]


def _without_cycles(graph: fx.Graph, regions: list[list[fx.Node]], pos: dict[fx.Node, int]) -> list[list[fx.Node]]:
    """Split groups on cycles into runs of graph-consecutive nodes, widest first, until the
    units can be ordered. (Runs of consecutive nodes never form a cycle.)"""
    while cyclic := _cyclic_groups(graph, regions):
        widest = max(cyclic, key=lambda i: pos[regions[i][-1]] - pos[regions[i][0]])
        assert pos[regions[widest][-1]] - pos[regions[widest][0]] >= len(regions[widest]), "consecutive run on a cycle"
        runs: list[list[fx.Node]] = []
        for n in regions.pop(widest):
            if runs and pos[n] == pos[runs[-1][-1]] + 1:
                runs[-1].append(n)
            else:
                runs.append([n])
        regions += runs
    return regions


def _worth_a_kernel(region: list[fx.Node]) -> bool:
    """Some computation (views alone compile to nothing): at least MIN_REGION_OPS ops, or one
    large dtype cast."""
    ops = [n for n in region if n.target is not operator.getitem and not n.target.is_view]
    return len(ops) >= MIN_REGION_OPS or (len(ops) == 1 and _large_cast(ops[0]))


def _large_cast(n: fx.Node) -> bool:
    val, src = n.meta.get("val"), n.args[0].meta.get("val") if n.args and isinstance(n.args[0], fx.Node) else None
    return (n.target is aten._to_copy.default and isinstance(val, torch.Tensor) and isinstance(src, torch.Tensor)
            and val.dtype != src.dtype and val.numel() >= LONE_CAST_MIN_ELEMENTS)


def fuse_regions_pass(gm: fx.GraphModule, *, ctx: PassContext) -> fx.GraphModule:
    """One region per module instance of a kind the model names (Llama: RMSNorm, RoPE, SwiGLU
    and the loss)."""
    key: dict[fx.Node, str] = {}
    for n in gm.graph.nodes:
        kind = ctx.model.region_kind(module_path(n)) if _fusable(n, key) else None
        if kind is not None:
            key[n] = f"{kind}@{module_path(n)}"
    return _tag_regions(gm, key)


def fuse_blocks_pass(gm: fx.GraphModule, *, ctx: PassContext) -> fx.GraphModule:
    """Regions across module boundaries within a transformer block (all element-wise and
    reduction work between its matmuls, attention and collectives: residual adds join the
    norms after them), as per-block torch.compile fuses."""
    key: dict[fx.Node, str | None] = {}
    for n in gm.graph.nodes:
        if _fusable(n, key):
            path = module_path(n)
            key[n] = f"block@{ctx.model.block_of(path)}" if path else None
    _blocks_of_unplaced(gm.graph, key)
    return _tag_regions(gm, key)


def _blocks_of_unplaced(graph: fx.Graph, key: dict[fx.Node, str | None]) -> None:
    """Give the fusable nodes no module placed (autograd's gradient sums and the views around
    them, in the backward) the block of an input that has one, else of a user that has one.
    Keyed by no block, such a node sat between two blocks' regions, a region of one op (no
    kernel: 177 such adds and 64 select_backwards stayed on ATen per Llama 3 1B step)."""
    for order, neighbours in ((graph.nodes, lambda n: n.all_input_nodes), (reversed(graph.nodes), lambda n: n.users)):
        for n in order:
            if n in key and key[n] is None:
                key[n] = next((key[m] for m in neighbours(n) if key.get(m) is not None), None)
    for n, k in key.items():
        if k is None:
            key[n] = "block@"


def fuse_exact_pass(gm: fx.GraphModule, *, ctx: PassContext) -> fx.GraphModule:
    """Regions of bit-exact element-wise ops (between reductions, matmuls, attention and
    collectives)."""
    # One key for all: backward nodes often carry no module, and exactness does not depend on it.
    return _tag_regions(gm, {n: "exact@" for n in gm.graph.nodes if exact_op(n)})


def _tag_regions(gm: fx.GraphModule, key: dict[fx.Node, str]) -> fx.GraphModule:
    graph = gm.graph
    pos = {n: i for i, n in enumerate(graph.nodes)}
    regions = _without_cycles(graph, [sorted(group, key=pos.__getitem__) for group in _convex_groups(graph, key)], pos)
    regions.sort(key=lambda r: pos[r[0]])
    regions = [r for r in regions if _worth_a_kernel(r)]
    region_of = {n: i for i, r in enumerate(regions) for n in r}
    stable_toposort(graph, together=region_of)
    for i, r in enumerate(regions):
        for n in r:
            n.meta["titan_region"] = f"{key[n].split('@')[0]}#{i}"
    graph.lint()
    gm.recompile()
    return gm
