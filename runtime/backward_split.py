"""A stage's backward cut in two for a zero-bubble schedule: the input-gradient part (I), which
the previous stage waits for, and the weight-gradient part (W), which can run later, in what
would otherwise be a bubble (Qi et al. 2024, "Zero Bubble Pipeline Parallelism").

Derived at load from the backward graph a stage program stores, (saved..., grad_output) ->
(parameter gradients..., input gradients...), so no format change is needed (as loss_only.py
derives validation from the stored forward):

- input:  (saved..., grad_output) -> (input gradients..., kept...): only the nodes the input
  gradients need, plus `kept`, the values the weight part reads that this part has (saved
  activations the weight gradients use, and intermediate gradients such as a linear layer's
  output gradient, computed here once);
- weight: (kept...) -> (parameter gradients...): every other node the parameter gradients need.

Every node of the backward lands in exactly one part, in its original order, with the same
inputs, so the two parts compute bitwise what the whole backward computes (tests/unit/
test_backward_split.py checks it with torch.equal). A backward graph is functional (no node
writes into another's memory), so moving a node behind another cannot change what it reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx


@dataclass(frozen=True)
class SplitBackward:
    input: fx.GraphModule
    """(saved..., grad_output) -> (input gradients..., kept...)."""
    weight: fx.GraphModule
    """(kept...) -> (parameter gradients...)."""
    n_input_grads: int
    """How many of the input part's outputs are input gradients (the rest is `kept`)."""


def _ancestors(roots) -> set[fx.Node]:
    """The nodes `roots` are computed from, themselves included."""
    seen: set[fx.Node] = set()
    stack = [n for n in roots if isinstance(n, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def split_backward(backward: fx.GraphModule, *, n_params: int) -> SplitBackward:
    """`backward`'s input- and weight-gradient parts (module docstring); its first `n_params`
    outputs are the parameters' gradients. `backward` itself is left as it is."""
    nodes = list(backward.graph.nodes)
    outputs = list(next(n for n in nodes if n.op == "output").args[0])
    param_grads, input_grads = outputs[:n_params], outputs[n_params:]
    for_input = _ancestors(input_grads)
    # A node with a side effect and no output depending on it (none in today's graphs) stays
    # where the input gradients are computed: it runs once, as in the whole backward.
    for_input |= _ancestors(n for n in nodes if n.op == "call_function" and n.is_impure() and not n.users)
    for_weight = _ancestors(param_grads)
    computed_in_weight = [n for n in nodes if n in for_weight and n not in for_input and n.op != "placeholder"]
    # What the weight part reads from the input part (or the backward's own inputs).
    reads = {arg for n in computed_in_weight for arg in n.all_input_nodes}
    reads |= {g for g in param_grads if isinstance(g, fx.Node)}
    kept = [n for n in nodes if n in reads and (n in for_input or n.op == "placeholder")]

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        if n.op == "placeholder" or (n in for_input and n.op != "output"):
            env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[g] if isinstance(g, fx.Node) else g for g in input_grads) + tuple(env[n] for n in kept))
    input_part = fx.GraphModule(backward, graph)

    graph = fx.Graph()
    env = {n: graph.placeholder(n.name) for n in kept}
    for n, new in env.items():
        new.meta = dict(n.meta)
    for n in computed_in_weight:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[g] if isinstance(g, fx.Node) else g for g in param_grads))
    weight_part = fx.GraphModule(backward, graph)
    return SplitBackward(input=input_part, weight=weight_part, n_input_grads=len(input_grads))
