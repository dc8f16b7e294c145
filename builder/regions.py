"""Fusion regions: exact element-wise regions (the default), and titan-build --fuse's RMSNorm,
RoPE, SwiGLU and loss regions or whole-block regions.

fuse_exact (default, numerics-preserving) groups only element-wise ops that inductor, under
runtime/fusion.py's exact settings, computes bit for bit as eager's kernels do (measured per op
on the GPU host by benchmarks/exact_ops.py; ops that measured different, and every reduction,
stay on eager kernels). The regions are tagged "exact#<n>".

The pass groups the element-wise and reduction work of each such module instance into
regions, orders the graph so that each region's nodes are consecutive, and tags them
(node.meta["titan_region"] = "<kind>#<n>", written to the graph as the node's "region").
titan-run compiles each region into generated kernels on the device it trains on
(runtime/fusion.py). Matmuls, attention and collectives stay outside regions. Fused kernels
keep intermediates in registers and reduce in their own order, so results differ from eager
in the last bits: the pass is opt-in and labeled as changing numerics.

A region is a connected set of same-module nodes that is convex (no path leaves it and comes
back), so that it can run as one call; a set that is not convex is cut into runs of nodes that
are consecutive in graph order, which always are.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from titan.builder.collectives import STARTS, WAIT, block_of, module_path, stable_toposort
from titan.builder.passes import PassContext

aten = torch.ops.aten
# Left to their own libraries: matmuls (cuBLAS), attention (flash), collectives (NCCL).
_NOT_FUSED = {aten.mm.default, aten.bmm.default, aten.addmm.default, WAIT, *STARTS}
MIN_REGION_OPS = 2


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
    if n.target.is_view and n.target.namespace == "aten":
        return True
    if n.target not in EXACT_OPS:
        return False
    if n.target in (aten.add.Tensor, aten.sub.Tensor) and n.kwargs.get("alpha", 1) != 1:
        return False  # eager may contract a + alpha * b into one FMA
    if n.target is aten.pow.Tensor_Scalar and n.args[1] not in _EXACT_POWERS:
        return False
    if n.target is aten._to_copy.default and set(n.kwargs) - {"dtype"}:
        return False  # a device or layout change is not a fusable cast
    return True


def region_kind(module: str) -> str | None:
    """The region kind of a node produced by `module`, or None (not fused)."""
    parts = module.split(".") if module else []
    if not parts:
        return "loss"  # the RoPE tables, the loss and its gradient: no module of their own
    if parts[-1] in ("attention_norm", "ffn_norm", "norm"):
        return "rms_norm"
    if len(parts) == 3 and parts[0] == "layers" and parts[2] == "attention":
        return "rope"
    if len(parts) == 3 and parts[0] == "layers" and parts[2] == "feed_forward":
        return "swiglu"
    return None


def _fusable(n: fx.Node, tagged: dict[fx.Node, str]) -> bool:
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        return n.args[0] in tagged
    return isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "aten" and n.target not in _NOT_FUSED


def _components(nodes: list[fx.Node], key: dict[fx.Node, str]) -> list[list[fx.Node]]:
    """Connected components of same-key nodes (data edges), each in graph order."""
    parent = {n: n for n in nodes}

    def find(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in nodes:
        for a in n.all_input_nodes:
            if a in key and key[a] == key[n]:
                parent[find(a)] = find(n)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:
        groups.setdefault(find(n), []).append(n)
    return list(groups.values())


def _convex(group: list[fx.Node], pos: dict[fx.Node, int]) -> bool:
    members = set(group)
    last = max(pos[n] for n in group)
    stack = [u for n in group for u in n.users if u not in members and pos[u] < last]
    seen = set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u in members:
                return False
            if pos[u] < last:
                stack.append(u)
    return True


def _runs(group: list[fx.Node], pos: dict[fx.Node, int]) -> list[list[fx.Node]]:
    runs: list[list[fx.Node]] = []
    for n in group:
        if runs and pos[n] == pos[runs[-1][-1]] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return runs


def fuse_regions_pass(gm: fx.GraphModule, *, ctx: PassContext) -> fx.GraphModule:
    """One region per RMSNorm, RoPE, SwiGLU and loss module instance."""
    key: dict[fx.Node, str] = {}
    for n in gm.graph.nodes:
        kind = region_kind(module_path(n)) if _fusable(n, key) else None
        if kind is not None:
            key[n] = f"{kind}@{module_path(n)}"
    return _tag_regions(gm, key)


def fuse_blocks_pass(gm: fx.GraphModule, *, ctx: PassContext) -> fx.GraphModule:
    """Regions across module boundaries within a transformer block (all element-wise and
    reduction work between its matmuls, attention and collectives: residual adds join the
    norms after them), as per-block torch.compile fuses."""
    key: dict[fx.Node, str] = {}
    for n in gm.graph.nodes:
        if _fusable(n, key):
            key[n] = f"block@{block_of(module_path(n))}"
    return _tag_regions(gm, key)


def fuse_exact_pass(gm: fx.GraphModule, *, ctx: PassContext) -> fx.GraphModule:
    """Regions of bit-exact element-wise ops within each transformer block (between its
    reductions, matmuls, attention and collectives)."""
    key: dict[fx.Node, str] = {}
    for n in gm.graph.nodes:
        if exact_op(n):
            key[n] = f"exact@{block_of(module_path(n))}"
    return _tag_regions(gm, key)


def _tag_regions(gm: fx.GraphModule, key: dict[fx.Node, str]) -> fx.GraphModule:
    graph = gm.graph
    pos = {n: i for i, n in enumerate(graph.nodes)}
    regions: list[list[fx.Node]] = []
    for group in _components([n for n in graph.nodes if n in key], key):
        regions += [group] if _convex(group, pos) else _runs(group, pos)
    # A region needs some computation: views alone compile to nothing.
    regions = [r for r in regions
               if sum(n.target is not operator.getitem and not n.target.is_view for n in r) >= MIN_REGION_OPS]
    region_of = {n: i for i, r in enumerate(regions) for n in r}
    stable_toposort(graph, together=region_of)
    for i, r in enumerate(regions):
        for n in r:
            n.meta["titan_region"] = f"{key[n].split('@')[0]}#{i}"
    graph.lint()
    gm.recompile()
    return gm
