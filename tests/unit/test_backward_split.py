"""runtime/backward_split.py: a stage's backward graph cut into a zero-bubble schedule's input-
and weight-gradient parts computes exactly (torch.equal) what the whole backward computes, on
the traced programs of a Llama 3 stage at each place in a pipeline; the input part computes only
what the input gradient needs. (The parts run in a pipeline: e2e/test_pipeline_bitwise.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.fx as fx

from titan.builder.models.decoder_stage import DecoderStage
from titan.builder.models.llama3.config import FLAVORS
from titan.builder.models.llama3.model import Llama3
from titan.builder.trace.stage_trace import trace_stage
from titan.runtime.backward_split import split_backward
from titan.runtime.contract.graph_decode import load_graph

CFG = dataclasses.replace(FLAVORS["debug"], n_layers=3, dim=64, n_heads=4, n_kv_heads=2, vocab_size=512)
ROWS, SEQ = 2, 16
PLACES = {"first": (0, 1), "middle": (1, 2), "last": (2, 3)}


def _matmuls(gm: fx.GraphModule) -> int:
    return sum(n.op == "call_function" and n.target is torch.ops.aten.mm.default for n in gm.graph.nodes)


@pytest.fixture(scope="module")
def stages():
    """Per place: the stage's parameters and its program's forward and backward, read back."""
    with torch.device("meta"):
        meta = Llama3(CFG)
    torch.manual_seed(0)
    model = Llama3(CFG)
    out = {}
    for place, (start, stop) in PLACES.items():
        first, last = start == 0, stop == CFG.n_layers
        inputs = ("tokens" if first else "activations",) + (("labels",) if last else ())
        program = trace_stage(DecoderStage(meta, start, stop, first=first, last=last), inputs=inputs,
                              micro_batch=(ROWS, SEQ), dim=CFG.dim)
        named = dict(DecoderStage(model, start, stop, first=first, last=last).named_parameters())
        fw, bw = (load_graph(blob, device=torch.device("cpu"), groups={}) for blob in (program.forward, program.backward))
        out[place] = ([named[p].detach() for p in program.params], inputs, fw, bw)
    return out


@pytest.mark.parametrize("place", PLACES)
def test_the_two_parts_compute_exactly_what_the_whole_backward_does(stages, place):
    params, inputs, fw, bw = stages[place]
    g = torch.Generator().manual_seed(1)
    values = {"tokens": torch.randint(0, CFG.vocab_size, (ROWS, SEQ), generator=g),
              "activations": torch.randn(ROWS, SEQ, CFG.dim, generator=g),
              "labels": torch.randint(0, CFG.vocab_size, (ROWS, SEQ), generator=g)}
    with torch.no_grad():
        out, *saved = fw(*params, *(values[k] for k in inputs))
        grad_output = torch.ones_like(out) if place == "last" else torch.randn(out.shape, generator=g)
        whole = bw(*saved, grad_output)
        split = split_backward(bw, n_params=len(params))
        first = split.input(*saved, grad_output)
        input_grads, kept = first[:split.n_input_grads], first[split.n_input_grads:]
        param_grads = split.weight(*kept)
    assert len(param_grads) == len(params) and len(input_grads) == len(inputs)
    assert all(torch.equal(a, b) for a, b in zip(whole[:len(params)], param_grads))
    received = inputs.index("tokens") if "tokens" in inputs else inputs.index("activations")
    if place == "first":  # tokens have no gradient: the input part has nothing to compute
        assert all(grad is None for grad in whole[len(params):]) and all(grad is None for grad in input_grads)
        assert not any(n.op == "call_function" for n in split.input.graph.nodes)
    else:
        assert torch.equal(whole[len(params) + received], input_grads[received])
    # Every matmul of the backward runs in exactly one part; the weight part has the weight
    # gradients' (one per linear weight, at least), so they do not delay the input gradient.
    linears = sum(p.dim() == 2 for p in params) - (place == "first")  # the embedding's gradient is a scatter
    assert _matmuls(split.input) + _matmuls(split.weight) == _matmuls(bw)
    assert _matmuls(split.weight) >= linears > 0
    # The stored graph is left as it was.
    assert torch.equal(bw(*saved, grad_output)[0], whole[0])


def test_the_input_part_keeps_what_the_weight_part_reads_and_computes_nothing_else():
    # The backward of y = x @ w: (saved x, w; grad of y) -> (grad of w, grad of x).
    def backward(x, w, grad_y):
        grad_w = torch.mm(x.t(), grad_y)
        grad_x = torch.mm(grad_y, w.t())
        return (grad_w, grad_x)

    split = split_backward(fx.symbolic_trace(backward), n_params=1)
    assert split.n_input_grads == 1
    assert [n.name for n in split.weight.graph.nodes if n.op == "placeholder"] == ["x", "grad_y"]
    assert [n.target for n in split.input.graph.nodes if n.op == "call_method"] == ["t"]  # w.t() only
    x, w, grad_y = torch.randn(3, 4), torch.randn(4, 5), torch.randn(3, 5)
    grad_x, *kept = split.input(x, w, grad_y)
    assert torch.equal(grad_x, grad_y @ w.t()) and torch.equal(split.weight(*kept)[0], x.t() @ grad_y)
