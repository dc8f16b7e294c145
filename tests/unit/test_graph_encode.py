"""Writing an FX graph in the titan graph format (runtime/contract/graph_encode.py) and reading it
back (graph_decode.py): the same computation, bit for bit, and the same bytes when written again;
process groups and devices written canonically, so that ranks which differ only in those write
identical bytes. (Graphs of real builds: e2e/; refusals of malformed blobs: test_graph_format.py.)"""

from __future__ import annotations

import msgpack
import pytest
import torch
import torch.fx as fx

from titan.runtime.contract.graph_decode import load_graph
from titan.runtime.contract.graph_encode import encode_graph

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
CPU = torch.device("cpu")


def _step_graph(device: torch.device = CPU) -> fx.GraphModule:
    """x @ w.t() + bias (a constant), cast to float64 on `device`, summed per row, and a view:
    tuples, lists, scalars, dtypes, devices, memory formats and a constant all in the one graph."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    bias = g.get_attr("bias")
    y = g.call_function(aten.add.Tensor, (g.call_function(aten.mm.default, (x, g.call_function(aten.t.default, (w,)))),
                                          bias))
    y = g.call_function(aten.mul.Tensor, (y, 0.5))
    wide = g.call_function(aten._to_copy.default, (y,), {"dtype": torch.float64, "device": device})
    rows = g.call_function(aten.sum.dim_IntList, (wide, [1], True))
    flat = g.call_function(aten.clone.default, (g.call_function(aten.view.default, (y, [-1])),),
                           {"memory_format": torch.contiguous_format})
    g.output((rows, flat))
    root = torch.nn.Module()
    root.register_buffer("bias", torch.arange(5, dtype=torch.float32) / 7)
    return fx.GraphModule(root, g)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g)


def test_a_graph_reads_back_computing_the_same_values_and_writes_the_same_bytes():
    gm = _step_graph()
    blob = encode_graph(gm, group_names={})
    loaded = load_graph(blob, device=CPU, groups={})
    want, got = gm(*_inputs()), loaded(*_inputs())
    assert len(got) == 2 and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))
    assert [n.name for n in loaded.graph.nodes] == [n.name for n in gm.graph.nodes]
    assert encode_graph(loaded, group_names={}) == blob


def test_devices_are_written_as_the_local_device_and_read_as_the_loading_one():
    on_gpu = encode_graph(_step_graph(torch.device("cuda", 3)), group_names={})
    assert on_gpu == encode_graph(_step_graph(CPU), group_names={})
    cast = next(n for n in load_graph(on_gpu, device=CPU, groups={}).graph.nodes if n.target is aten._to_copy.default)
    assert cast.kwargs == {"dtype": torch.float64, "device": CPU}


def _all_reduce_graph(group: str) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_reduce.default, (x, "sum", group)),)),))
    return fx.GraphModule(torch.nn.Module(), g)


def test_process_groups_are_written_by_mesh_dimension_and_bound_at_load():
    # Two ranks created their groups in another order: their graphs name different groups.
    rank0 = encode_graph(_all_reduce_graph("7"), group_names={"7": "tp", "8": "dp_shard"})
    rank1 = encode_graph(_all_reduce_graph("9"), group_names={"9": "tp", "5": "dp_shard"})
    assert rank0 == rank1
    reduce = next(n for n in msgpack.unpackb(rank0, raw=False)["nodes"] if n["op"] == "call_function")
    assert reduce["args"] == [{"$n": 0}, "sum", {"$group": "tp"}]
    loaded = load_graph(rank0, device=CPU, groups={"tp": "11"})
    assert next(n for n in loaded.graph.nodes if n.target is c10d.all_reduce.default).args[2] == "11"
    with pytest.raises(ValueError, match="collective on process group '7', which is not a mesh dimension"):
        encode_graph(_all_reduce_graph("7"), group_names={"8": "tp"})


def test_values_are_described_by_shape_stride_and_dtype():
    gm = _step_graph()
    x, w = _inputs()
    for node, val in zip(list(gm.graph.nodes)[:2], (x.t(), w)):
        node.meta["val"] = val
    loaded = load_graph(encode_graph(gm, group_names={}), device=CPU, groups={})
    assert [n.meta["titan_val"] for n in list(loaded.graph.nodes)[:3]] == [
        {"shape": [4, 3], "stride": [1, 4], "dtype": "float32"}, {"shape": [5, 4], "stride": [4, 1], "dtype": "float32"},
        None]


def test_what_the_format_cannot_hold_is_refused_when_written():
    gm = _step_graph()
    next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor).args = (next(iter(gm.graph.nodes)), object())
    with pytest.raises(ValueError, match="cannot encode graph argument"):
        encode_graph(gm, group_names={})
