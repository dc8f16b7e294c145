"""The validation program (runtime/loss_only.py): the forward graph with the loss as its only
output computes the same loss, drops what only the backward or the buffers needed, and keeps
every collective (each rank of a group must issue the same ones)."""

from __future__ import annotations

import torch
import torch.fx as fx

from titan.runtime.loss_only import loss_only


def _forward() -> fx.GraphModule:
    """(buffer update, loss, saved activation, saved all-reduced activation), as a training forward returns."""
    g = fx.Graph()
    x, w, b = g.placeholder("x"), g.placeholder("w"), g.placeholder("bias")
    h = g.call_function(torch.ops.aten.mm.default, (x, w))
    act = g.call_function(torch.ops.aten.relu.default, (h,))
    loss = g.call_function(torch.ops.aten.sum.default, (act,))
    saved = g.call_function(torch.ops.aten.mul.Tensor, (h, 2.0))
    reduced = g.call_function(torch.ops._c10d_functional.all_reduce.default, (saved, "sum", "tp"))
    update = g.call_function(torch.ops.aten.add.Tensor, (b, 1.0))
    g.output((update, loss, act, reduced))
    return fx.GraphModule(torch.nn.Module(), g)


def test_the_loss_alone_is_computed_as_in_training_and_collectives_stay():
    forward = _forward()
    val = loss_only(forward, 1)
    targets = [n.target for n in val.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.add.Tensor not in targets  # the buffer update: gone
    assert torch.ops._c10d_functional.all_reduce.default in targets  # a collective: kept (and what it reads)
    assert torch.ops.aten.mul.Tensor in targets
    assert len(list(forward.graph.nodes)) == 10  # the training forward is left as it was
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    h = torch.mm(x, w)
    (loss,) = loss_only(_without_collective(), 1)(x, w, torch.zeros(5))
    assert torch.equal(loss, torch.relu(h).sum())


def _without_collective() -> fx.GraphModule:
    """_forward() with the all-reduce's output replaced, so the graph runs without a process group."""
    gm = _forward()
    for n in list(gm.graph.nodes):
        if n.target == torch.ops._c10d_functional.all_reduce.default:
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
    gm.recompile()
    return gm
