"""runtime/stage_gather.py and stage_reduce.py: a stage's graphs cut into a once-per-step gather
of what its parameters alone determine and per-micro-batch compute parts compute exactly
(torch.equal) what the stored graphs compute; a backward's recomputation of a gathered value reads the forward's
instead of computing it again; a backward cut at its reduce-scatters hands the unsharded buckets
to a once-per-step reduce part. (With dp-shard all-gathers, bitwise against torch's pipelining:
e2e/test_pipeline_artifacts.py.)"""

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
from titan.runtime.stage_gather import count_collectives, gather_once
from titan.runtime.stage_reduce import reduce_once

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
CFG = dataclasses.replace(FLAVORS["debug"], n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=512)
ROWS, SEQ = 2, 16
DP_SHARD = {"dp_shard": "dp_shard"}


@pytest.mark.parametrize("place", ["first", "last"])
def test_gathered_once_a_stage_computes_exactly_what_its_stored_graphs_do(place):
    start, stop = (0, 1) if place == "first" else (1, 2)
    first, last = place == "first", place == "last"
    inputs = ("tokens" if first else "activations",) + (("labels",) if last else ())
    with torch.device("meta"):
        meta = Llama3(CFG)
    program = trace_stage(DecoderStage(meta, start, stop, first=first, last=last), inputs=inputs,
                          micro_batch=(ROWS, SEQ), dim=CFG.dim)
    torch.manual_seed(0)
    named = dict(DecoderStage(Llama3(CFG), start, stop, first=first, last=last).named_parameters())
    params = [named[p].detach() for p in program.params]
    fw, bw = (load_graph(blob, device=torch.device("cpu"), groups={}) for blob in (program.forward, program.backward))
    cut = gather_once(fw, bw, n_params=len(params))
    # Without a mesh the parameters' own nodes are views (the linear weights' transposes): moved,
    # holding no memory of their own.
    assert cut.n_values > 0 and cut.resident_bytes == 0
    assert not any(n.op == "call_function" and n.target in (aten.t.default, aten.view.default)
                   and n.all_input_nodes and n.all_input_nodes[0].op == "placeholder"
                   and n.all_input_nodes[0].name in {p.name for p in list(fw.graph.nodes)[:len(params)]}
                   for n in cut.forward.graph.nodes)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        values = cut.gather(*params)
        for _ in range(2):  # two micro-batches on the same gathered values
            data = {"tokens": torch.randint(0, CFG.vocab_size, (ROWS, SEQ), generator=g),
                    "activations": torch.randn(ROWS, SEQ, CFG.dim, generator=g),
                    "labels": torch.randint(0, CFG.vocab_size, (ROWS, SEQ), generator=g)}
            stored = fw(*params, *(data[k] for k in inputs))
            gathered = cut.forward(*values, *params, *(data[k] for k in inputs))
            assert len(stored) == len(gathered) and all(torch.equal(a, b) for a, b in zip(stored, gathered))
            out, *saved = stored
            grad_output = torch.ones_like(out) if last else torch.randn(out.shape, generator=g)
            whole = bw(*saved, grad_output)
            cut_grads = cut.backward(*values, *gathered[1:], grad_output)
            assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(whole, cut_grads))
            # A zero-bubble schedule cuts the gathered backward as it cuts the stored one.
            split = split_backward(cut.backward, n_params=len(params))
            first_part = split.input(*values, *gathered[1:], grad_output)
            weight_grads = split.weight(*first_part[split.n_input_grads:])
            assert all(torch.equal(a, b) for a, b in zip(whole[:len(params)], weight_grads))


def test_a_backward_recomputing_a_gathered_value_reads_the_forwards():
    # forward (w, x) -> (y, saved w, saved x); the backward recomputes w * 2 from the saved w, as
    # activation checkpointing recomputes a block's gathered weights.
    def forward(w, x):
        w2 = aten.mul.Tensor(w, 2.0)
        return (aten.mm.default(x, w2), w, x)

    def backward(w, x, grad_y):
        w2 = aten.mul.Tensor(w, 2.0)
        return (aten.mm.default(aten.t.default(x), grad_y), aten.mm.default(grad_y, aten.t.default(w2)))

    cut = gather_once(fx.symbolic_trace(forward), fx.symbolic_trace(backward), n_params=1)
    muls = [n for n in cut.gather.graph.nodes if n.target is aten.mul.Tensor]
    # One w * 2 for the step: the forward reads it, the backward its transpose (moved too).
    assert len(muls) == 1 and cut.n_values == 2
    assert not any(n.target is aten.mul.Tensor for gm in (cut.forward, cut.backward) for n in gm.graph.nodes)
    w, x, grad_y = torch.randn(4, 5), torch.randn(3, 4), torch.randn(3, 5)
    values = cut.gather(w)
    y, *saved = cut.forward(*values, w, x)
    assert torch.equal(y, x @ (w * 2))
    grad_w, grad_x = cut.backward(*values, *saved, grad_y)
    assert torch.equal(grad_x, grad_y @ (w * 2).t()) and torch.equal(grad_w, x.t() @ grad_y)
    assert count_collectives(cut.gather) == {}


def _backward_with_a_reduce_scatter(after, group: str = "dp_shard") -> fx.GraphModule:
    """(saved x, grad_y) -> (grad of w: x^T grad_y reduce-scattered over `group`, then `after`; grad of x)."""
    g = fx.Graph()
    x, grad_y = g.placeholder("x"), g.placeholder("grad_y")
    bucket = g.call_function(aten.view.default, (g.call_function(aten.mm.default, (g.call_function(aten.t.default, (x,)),
                                                                                  grad_y)), [-1]))
    reduced = g.call_function(c10d.wait_tensor.default,
                              (g.call_function(c10d.reduce_scatter_tensor.default, (bucket, "sum", 2, group)),))
    grad_x = g.call_function(aten.mm.default, (grad_y, x))
    g.output((after(g, reduced), grad_x))
    return fx.GraphModule(torch.nn.Module(), g)



def test_reducing_once_per_step_moves_the_reduce_scatters_and_what_cuts_their_results():
    cut = reduce_once(_backward_with_a_reduce_scatter(lambda g, r: g.call_function(aten.view.default, (r, [2, 4]))),
                      n_params=1, groups=DP_SHARD)
    assert cut.n_partials == 1  # the unsharded bucket, summed over the micro-batches
    assert count_collectives(cut.compute) == {} and count_collectives(cut.reduce) == {"reduce-scatter": 1}
    out = next(n for n in cut.compute.graph.nodes if n.op == "output").args[0]
    assert out[1] is None and out[0].target is aten.view.default and out[2].target is aten.mm.default
    assert [n.target for n in cut.reduce.graph.nodes if n.op == "call_function"] == [
        c10d.reduce_scatter_tensor.default, c10d.wait_tensor.default, aten.view.default]
    assert reduce_once(fx.symbolic_trace(lambda x: (x * 2,)), n_params=1, groups=DP_SHARD) is None  # nothing to reduce
    # Tensor parallelism's reduce-scatters (activation gradients every micro-batch needs) are not gradient reductions.
    tp_only = _backward_with_a_reduce_scatter(lambda g, r: g.call_function(aten.mul.Tensor, (r, r)), group="tp")
    assert reduce_once(tp_only, n_params=1, groups={"dp_shard": "dp_shard", "tp": "tp"}) is None


def test_reducing_once_per_step_is_refused_where_a_reduced_gradient_is_not_cut_linearly():
    with pytest.raises(ValueError, match="cannot wait for the step's last micro-batch"):
        reduce_once(_backward_with_a_reduce_scatter(lambda g, r: g.call_function(aten.mul.Tensor, (r, r))), n_params=1,
                    groups=DP_SHARD)


def test_reducing_once_per_step_moves_the_replicas_all_reduces_and_keeps_a_statistic_the_backward_uses():
    """HSDP: each parameter's gradient all-reduced over the replicas, the bucket (a cat of them)
    reduce-scattered over dp-shard: all of it moves. An all-reduce over a data-parallel group whose
    result the backward computes with (a statistic) stays in every micro-batch."""
    g = fx.Graph()
    x, grad_y = g.placeholder("x"), g.placeholder("grad_y")
    grads = [g.call_function(aten.mm.default, (g.call_function(aten.t.default, (x,)), grad_y)) for _ in range(2)]
    summed = [g.call_function(c10d.wait_tensor.default,
                              (g.call_function(c10d.all_reduce.default, (w, "sum", "dp_replicate")),)) for w in grads]
    bucket = g.call_function(aten.cat.default, ([g.call_function(aten.view.default, (w, [-1])) for w in summed],))
    shard = g.call_function(c10d.wait_tensor.default,
                            (g.call_function(c10d.reduce_scatter_tensor.default, (bucket, "sum", 2, "dp_shard")),))
    halves = [g.call_function(aten.slice.Tensor, (shard, 0, i * 4, i * 4 + 4)) for i in range(2)]
    statistic = g.call_function(c10d.wait_tensor.default,
                                (g.call_function(c10d.all_reduce.default, (grad_y, "sum", "dp_replicate")),))
    g.output((*halves, g.call_function(aten.mul.Tensor, (x, statistic))))
    hsdp = {"dp_replicate": "group-r", "dp_shard": "group-s"}
    for n in g.nodes:  # the collectives name this process's groups, as titan-run binds them
        if n.target in (c10d.all_reduce.default, c10d.reduce_scatter_tensor.default):
            n.args = (*n.args[:-1], hsdp[n.args[-1]])
    cut = reduce_once(fx.GraphModule(torch.nn.Module(), g), n_params=2, groups=hsdp)
    assert cut.n_partials == 2  # each parameter's gradient before the replicas' all-reduce
    assert count_collectives(cut.reduce) == {"all-reduce": 2, "reduce-scatter": 1}
    assert count_collectives(cut.compute) == {"all-reduce": 1}
