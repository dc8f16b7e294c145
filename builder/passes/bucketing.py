"""FSDP collective bucketing: one all-gather / one reduce-scatter per transformer block.

The traced graph all-gathers every parameter shard and reduce-scatters every gradient on
its own: hundreds of small collectives for an 8B model. These passes merge those of one
block (same process group and dtype) into one collective on a flat buffer:

- all-gather: cat(flat shards) -> all_gather -> view (world, n) -> per parameter, its
  columns copied out contiguous and viewed as the gathered parameter. Only copies: the
  gathered values are bit for bit those of the separate all-gathers.
- reduce-scatter: per gradient view (world, n) -> cat on dim 1 -> reduce_scatter -> per
  parameter, its slice of this rank's output. Rank r's output holds, for every parameter,
  exactly the elements the separate reduce-scatter gave it, each summed over the same ranks.

Each bucket is recorded in the rank's bucket plan (artifact metadata).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.fx as fx

from titan.builder.passes.collectives import ALL_GATHER, REDUCE_SCATTER, WAIT, Collective, collectives
from titan.builder.passes.fx_graph import emit, hoist_ancestors, module_path, stable_toposort
from titan.builder.passes.registry import PassContext
from titan.runtime.contract.rank_record import Bucket

aten = torch.ops.aten


def _fsdp(ctx: PassContext, target, graph: fx.Graph) -> list[Collective]:
    return [c for c in collectives(graph) if c.start.target is target and ctx.mesh_dims.get(c.group) == "dp_shard"]


def _input_param(node: fx.Node, ctx: PassContext, placeholder_index: dict[fx.Node, int]) -> str | None:
    """The parameter whose (cast, viewed) shard feeds `node`, if it comes from one input."""
    seen = node
    while seen.op != "placeholder":
        inputs = seen.all_input_nodes
        if len(inputs) != 1:
            return None
        seen = inputs[0]
    index = placeholder_index[seen]
    return ctx.input_names[index] if index < len(ctx.input_names) else None


def _output_param(node: fx.Node, ctx: PassContext, output_index: dict[fx.Node, int]) -> str | None:
    index = output_index.get(node)
    return ctx.output_names[index] if index is not None and index < len(ctx.output_names) else None


def _buckets(members: list[Collective], ctx: PassContext) -> list[list[Collective]]:
    """Group by (block, group, dtype[, reduce op]), in order of first appearance."""
    by_key: dict[tuple, list[Collective]] = defaultdict(list)
    for c in members:
        x = c.start.args[0].meta["val"]
        by_key[(ctx.model.block_of(module_path(c.start)), c.group, x.dtype, c.start.args[1])].append(c)
    return list(by_key.values())


def _flat_contiguous(graph: fx.Graph, x: fx.Node, shape: list[int]) -> fx.Node:
    if not x.meta["val"].is_contiguous():
        x = emit(graph, aten.clone.default, (x,), {"memory_format": torch.contiguous_format}, like=x)
    return emit(graph, aten.view.default, (x, shape), like=x)


def _record(ctx: PassContext, kind: str, bucket: list[Collective], names: list[str | None], n: int, world: int,
            dtype: torch.dtype) -> None:
    first = bucket[0].start
    ctx.plan.append(Bucket(
        graph=ctx.graph, kind=kind, group=ctx.mesh_dims[bucket[0].group],
        block=ctx.model.block_of(module_path(first)),
        params=tuple(p or module_path(c.start) for p, c in zip(names, bucket)),
        elements=n, dtype=str(dtype).removeprefix("torch."),
        bytes=n * world * torch.empty((), dtype=dtype).element_size(),
    ))


def _erase(graph: fx.Graph, bucket: list[Collective]) -> None:
    """Drop the bucket's own collectives once the merged one serves their users."""
    for c in bucket:
        graph.erase_node(c.wait)
        graph.erase_node(c.start)


def _finish(gm: fx.GraphModule) -> fx.GraphModule:
    stable_toposort(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm


def bucket_all_gather_pass(gm: fx.GraphModule, *, ctx: PassContext) -> fx.GraphModule:
    graph = gm.graph
    placeholder_index = {n: i for i, n in enumerate(n for n in graph.nodes if n.op == "placeholder")}
    for bucket in _buckets(_fsdp(ctx, ALL_GATHER, graph), ctx):
        first = bucket[0].start
        world, group = first.args[1], first.args[2]
        shards = [c.start.args[0] for c in bucket]
        sizes = [s.meta["val"].numel() for s in shards]
        names = [_input_param(c.start, ctx, placeholder_index) for c in bucket]
        _record(ctx, "all_gather", bucket, names, sum(sizes), world, shards[0].meta["val"].dtype)
        if len(bucket) == 1:
            continue
        hoist_ancestors([c.start for c in bucket[1:]], first)
        with graph.inserting_before(first):
            flat = [_flat_contiguous(graph, s, [-1]) for s in shards]
            cat = emit(graph, aten.cat.default, (flat,), like=first)
            gathered = emit(graph, ALL_GATHER, (cat, world, group), like=first)
        waits = {c.wait for c in bucket}
        first_wait = first.next
        while first_wait not in waits:
            first_wait = first_wait.next
        with graph.inserting_before(first_wait):
            wait = emit(graph, WAIT, (gathered,), like=first)
            rows = emit(graph, aten.view.default, (wait, [world, sum(sizes)]), like=first)
            offset = 0
            for c, n in zip(bucket, sizes):
                cols = emit(graph, aten.slice.Tensor, (rows, 1, offset, offset + n), like=c.start)
                dense = emit(graph, aten.clone.default, (cols,), {"memory_format": torch.contiguous_format},
                             like=c.start)
                full = emit(graph, aten.view.default, (dense, list(c.wait.meta["val"].shape)), like=c.start)
                c.wait.replace_all_uses_with(full)
                offset += n
        _erase(graph, bucket)
    return _finish(gm)


def bucket_reduce_scatter_pass(gm: fx.GraphModule, *, ctx: PassContext) -> fx.GraphModule:
    graph = gm.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    output_index: dict[fx.Node, int] = {}
    for i, n in enumerate(output.args[0]):
        output_index.setdefault(n, i)
    for bucket in _buckets(_fsdp(ctx, REDUCE_SCATTER, graph), ctx):
        last = bucket[-1].start
        op, world, group = last.args[1], last.args[2], last.args[3]
        grads = [c.start.args[0] for c in bucket]
        sizes = [g.meta["val"].numel() // world for g in grads]
        names = [_output_param(c.wait, ctx, output_index) for c in bucket]
        _record(ctx, "reduce_scatter", bucket, names, sum(sizes), world, grads[0].meta["val"].dtype)
        if len(bucket) == 1:
            continue
        with graph.inserting_before(last.next):
            rows = [_flat_contiguous(graph, g, [world, n]) for g, n in zip(grads, sizes)]
            cat = emit(graph, aten.cat.default, (rows, 1), like=last)
            flat = emit(graph, aten.view.default, (cat, [world * sum(sizes)]), like=last)
            scattered = emit(graph, REDUCE_SCATTER, (flat, op, world, group), like=last)
            wait = emit(graph, WAIT, (scattered,), like=last)
            offset = 0
            for c, n in zip(bucket, sizes):
                part = emit(graph, aten.slice.Tensor, (wait, 0, offset, offset + n), like=c.start)
                shard = emit(graph, aten.view.default, (part, list(c.wait.meta["val"].shape)), like=c.start)
                c.wait.replace_all_uses_with(shard)
                offset += n
        _erase(graph, bucket)
    return _finish(gm)
