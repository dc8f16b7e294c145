"""A pipeline stage's gradient reductions run once per step, after its last micro-batch
(titan-run --pp-reduce-per-step, opt-in: it changes the numerics).

A stage program's backward reduces its gradients itself over the data-parallel groups: SimpleFSDP
reduce-scatters each bucket's unsharded gradient over the dp-shard ranks, and all-reduces over the
replicas (HSDP) or over the ranks that share an expert-parallel MoE's dense parameters. A pipeline
runs that backward, and so those collectives, once per micro-batch, and adds the results up.
`reduce_once` cuts the backward where those reductions start (tensor parallelism's collectives, of
activation gradients each micro-batch needs, stay where they are), at load (a pure function on fx
graphs, no format change, as stage_gather.py):

- compute: (the backward's inputs...) -> (partials..., parameter gradients..., input gradients...):
  everything before the reductions; `partials` are what they read (each bucket's or parameter's
  unreduced gradient), the parameter gradients None where the reduce part gives them;
- reduce:  (partials...) -> (parameter gradients...): the reductions, their waits and what cuts
  the reduced buckets into each parameter's shard (None for a gradient the compute part gives).

The stage sums each micro-batch's partials (in micro-batch order) and runs the reduce part once
after its last backward. The reduce part is linear (collectives that sum, copies, views), so this
is the same sum, in another order: reduce(g0 + g1 + ...) instead of reduce(g0) + reduce(g1) + ...,
so the result differs in the last bits (not bitwise titan-verify's reference). Memory: each
stage holds its unreduced fp32 gradients for the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from titan.runtime.contract.layout import DP_DIMS

_c10d = torch.ops._c10d_functional
_REDUCE_SCATTER = _c10d.reduce_scatter_tensor.default
_ALL_REDUCE = _c10d.all_reduce.default
# What the reduce part may hold: ops linear in the summed partials.
_LINEAR = {_REDUCE_SCATTER, _c10d.wait_tensor.default, _ALL_REDUCE, torch.ops.aten.cat.default,
           torch.ops.aten.clone.default, torch.ops.aten._to_copy.default, torch.ops.aten.contiguous.default}


@dataclass(frozen=True)
class StageReduce:
    compute: fx.GraphModule
    """(the backward's inputs...) -> (partials..., parameter gradients or None..., input gradients...)."""
    reduce: fx.GraphModule
    """(partials...) -> (parameter gradients or None...)."""
    n_partials: int


def _linear(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target in (_REDUCE_SCATTER, _ALL_REDUCE) and node.args[1] != "sum":
        return False
    return target in _LINEAR or target.is_view


def _over(node: fx.Node, target, dp_groups: set[str]) -> bool:
    return node.op == "call_function" and node.target is target and node.args[-1] in dp_groups


def _only_reduces_gradients(node: fx.Node, output: fx.Node, n_params: int) -> bool:
    """Whether all that follows `node` is linear and ends in parameter gradients alone."""
    others = {g for g in output.args[0][n_params:] if isinstance(g, fx.Node)}
    seen, todo = {node}, [node]
    while todo:
        n = todo.pop()
        if n in others:
            return False
        for u in n.users:
            if u is not output and u not in seen:
                if not _linear(u):
                    return False
                seen.add(u)
                todo.append(u)
    return True


def _gradient_reductions(nodes: list[fx.Node], dp_groups: set[str], n_params: int) -> set[fx.Node]:
    """Where the backward starts reducing gradients over the data-parallel groups: each
    reduce-scatter (SimpleFSDP's, of a bucket) and each all-reduce whose results become parameter
    gradients alone, linearly (HSDP's over the replicas, or the ranks that share the dense
    parameters of an expert-parallel MoE). An all-reduce over those groups that feeds more (a
    statistic the backward computes with) stays in every micro-batch."""
    output = nodes[-1]
    return {n for n in nodes if _over(n, _REDUCE_SCATTER, dp_groups) or (
        _over(n, _ALL_REDUCE, dp_groups) and _linear(n) and _only_reduces_gradients(n, output, n_params))}


def reduce_once(backward: fx.GraphModule, *, n_params: int, groups: dict[str, str]) -> StageReduce | None:
    """The backward cut where it starts reducing gradients (module docstring); None if it does not.
    Its first `n_params` outputs are the parameters' gradients; `groups` maps mesh dimensions to
    the process-group names its collectives carry. Raises ValueError where what follows a gradient
    reduce-scatter is not linear or feeds more than parameter gradients."""
    dp_groups = {groups[dim] for dim in DP_DIMS if dim in groups}
    nodes = list(backward.graph.nodes)
    output = nodes[-1]
    outputs = list(output.args[0])
    starts = _gradient_reductions(nodes, dp_groups, n_params)
    after: set[fx.Node] = set()
    for n in nodes:
        if n in starts or any(i in after for i in n.all_input_nodes):
            if n is not output:
                after.add(n)
    if not after:
        return None
    for n in after:
        if not _linear(n):
            raise ValueError(f"--pp-reduce-per-step: the stage's backward computes {n.target} from a reduced "
                             "gradient, so its reduce-scatters cannot wait for the step's last micro-batch; "
                             "run without --pp-reduce-per-step")
    if any(isinstance(g, fx.Node) and g in after for g in outputs[n_params:]) or \
            any(u not in after and u is not output for n in after for u in n.users):
        raise ValueError("--pp-reduce-per-step: a reduced gradient feeds more than the parameters' gradients; "
                         "run without --pp-reduce-per-step")
    partials = [n for n in nodes if n not in after and n.op != "output" and any(u in after for u in n.users)]
    assert all(n.op != "placeholder" for n in partials), "a reduce-scatter reads what the backward computes"

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes[:-1]:
        if n not in after:
            env[n] = graph.node_copy(n, env.__getitem__)
    grads = [None if (isinstance(g, fx.Node) and g in after) else (env[g] if isinstance(g, fx.Node) else g)
             for g in outputs[:n_params]]
    rest = [env[g] if isinstance(g, fx.Node) else g for g in outputs[n_params:]]
    graph.output(tuple([env[n] for n in partials] + grads + rest))
    compute = fx.GraphModule(backward, graph)

    graph = fx.Graph()
    env = {}
    for n in partials:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in nodes:
        if n in after:
            env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[g] if isinstance(g, fx.Node) and g in after else None for g in outputs[:n_params]))
    return StageReduce(compute=compute, reduce=fx.GraphModule(backward, graph), n_partials=len(partials))
