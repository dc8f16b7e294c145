"""A pipeline stage's gradient reduce-scatters run once per step, after its last micro-batch
(titan-run --pp-reduce-per-step, opt-in: it changes the numerics).

A stage program's backward reduce-scatters its gradients itself (SimpleFSDP): each bucket's
unsharded gradient, summed over the dp-shard ranks, comes back as this rank's shards; a pipeline
runs that backward, and so the reduce-scatters, once per micro-batch, and adds the shards up.
`reduce_once` cuts the backward at those gradient reduce-scatters (the ones over a data-parallel
group; tensor parallelism's reduce-scatters of activation gradients stay where they are: each
micro-batch's backward needs their results), at load (a pure function on fx graphs, no format
change, as stage_gather.py):

- compute: (the backward's inputs...) -> (partials..., parameter gradients..., input gradients...):
  everything before the reduce-scatters; `partials` are what they read (each bucket's unsharded
  gradient), the parameter gradients None where the reduce part gives them;
- reduce:  (partials...) -> (parameter gradients...): the reduce-scatters, their waits and what
  cuts the reduced buckets into each parameter's shard (None for a gradient the compute part gives).

The stage sums each micro-batch's partials (in micro-batch order) and runs the reduce part once
after its last backward. The reduce part is linear (collectives that sum, copies, views), so this
is the same sum, in another order: reduce(g0 + g1 + ...) instead of reduce(g0) + reduce(g1) + ...,
so the result differs in the last bits (not bitwise titan-verify's reference). Memory: each
stage holds its unsharded fp32 gradient buckets for the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from titan.runtime.contract.layout import DP_DIMS

_c10d = torch.ops._c10d_functional
_REDUCE_SCATTER = _c10d.reduce_scatter_tensor.default
# What the reduce part may hold: ops linear in the summed partials.
_LINEAR = {_REDUCE_SCATTER, _c10d.wait_tensor.default, _c10d.all_reduce.default, torch.ops.aten.clone.default,
           torch.ops.aten._to_copy.default, torch.ops.aten.contiguous.default}


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
    if target in (_REDUCE_SCATTER, _c10d.all_reduce.default) and node.args[1] != "sum":
        return False
    return target in _LINEAR or target.is_view


def _reduces_gradients(node: fx.Node, dp_groups: set[str]) -> bool:
    return node.op == "call_function" and node.target is _REDUCE_SCATTER and node.args[3] in dp_groups


def reduce_once(backward: fx.GraphModule, *, n_params: int, groups: dict[str, str]) -> StageReduce | None:
    """The backward cut at its gradient reduce-scatters (module docstring); None if it has none.
    Its first `n_params` outputs are the parameters' gradients; `groups` maps mesh dimensions to
    the process-group names its collectives carry. Raises ValueError where what follows a gradient
    reduce-scatter is not linear or feeds more than parameter gradients."""
    dp_groups = {groups[dim] for dim in DP_DIMS if dim in groups}
    nodes = list(backward.graph.nodes)
    output = nodes[-1]
    outputs = list(output.args[0])
    after: set[fx.Node] = set()
    for n in nodes:
        if _reduces_gradients(n, dp_groups) or any(i in after for i in n.all_input_nodes):
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
