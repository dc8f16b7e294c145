"""A pipeline stage's model buffers (runtime/pipeline_stage.py's GraphStage): a forward's buffer
updates take effect at once, as eager PyTorch's in-place updates do (the next micro-batch's
forward reads them, before this one's backward), while what the backward recomputes from (the
buffer saved as it was) keeps the old value; the received activations' gradient is found past
the buffers' empty gradients. The graphs here are plain functions of the traced programs'
signature: forward (params, buffers, activations) -> (buffer updates, output, saved...),
backward (saved..., output gradient) -> (one gradient per forward input)."""

from __future__ import annotations

import torch

from titan.runtime.pipeline_stage import GraphStage


def test_a_forwards_buffer_update_is_seen_by_the_next_micro_batch_and_not_by_its_own_backward():
    weight, bias = torch.full((2,), 3.0), torch.zeros(2)

    def forward(w, b, x):
        # The update, the output (reads the buffer), and the buffer itself saved (as activation
        # checkpointing saves it to recompute from).
        return b + 1, x * w + b, b

    def backward(saved_b, grad):
        return saved_b * grad, None, grad * 2  # weight, buffer (none), activations

    stage = GraphStage(forward=forward, backward=backward, params=[weight], inputs=("activations",), tokens=(),
                       labels=(), activation_shape=(2,), dtype=torch.float32, buffers=[bias], updated=[bias])
    x = torch.ones(2)
    assert torch.equal(stage.forward(0, x), torch.full((2,), 3.0))  # read bias 0
    assert torch.equal(bias, torch.ones(2))  # updated at once
    assert torch.equal(stage.forward(1, x), torch.full((2,), 4.0))  # micro-batch 1 reads bias 1
    assert torch.equal(bias, torch.full((2,), 2.0))
    grad_input = stage.backward(0, torch.ones(2))
    assert torch.equal(weight.grad, torch.zeros(2))  # micro-batch 0's backward read the bias it ran with
    assert torch.equal(grad_input, torch.full((2,), 2.0))  # the activations' gradient, past the buffer's None
    stage.backward(1, torch.ones(2))
    assert torch.equal(weight.grad, torch.ones(2))
