"""The validation program: a rank's forward graph cut down to its loss.

The training forward returns, besides the loss, the model's buffer updates and every activation
the backward will read. A held-out batch needs the loss alone, so the program validation runs is
that graph with the loss as its only output and every node the loss does not need removed:
neither the saved activations nor the buffer updates are computed or kept alive. What remains is
the same nodes in the same order as in training, so the loss is bitwise the training forward's
(and eager's; titan-verify checks it).

A collective is never removed, even when its result feeds only the backward: every rank of a
group must issue the same collectives, and nothing proves that the graphs of two programs lose
the same ones.
"""

from __future__ import annotations

import torch.fx as fx

COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d")


def _kept(node: fx.Node) -> bool:
    if node.is_impure():
        return True
    return node.op == "call_function" and getattr(node.target, "namespace", None) in COLLECTIVE_NAMESPACES


def loss_only(forward: fx.GraphModule, loss_index: int) -> fx.GraphModule:
    """`forward` returning only its output `loss_index` (as a one-element tuple), the nodes it
    does not need dropped; `forward` itself is left as it is."""
    graph = fx.Graph()
    outputs = graph.graph_copy(forward.graph, {})
    graph.output((outputs[loss_index],))
    graph.eliminate_dead_code(is_impure_node=_kept)
    return fx.GraphModule(forward, graph)
