"""The graph format loads only allow-listed ops and well-formed node lists."""

from __future__ import annotations

import msgpack
import pytest
import torch

from titan.runtime.graph_format import GraphFormatError, load_graph


def _blob(nodes, **extra) -> bytes:
    return msgpack.packb({"format": "titan-graph", "version": 1, "nodes": nodes, "constants": None, **extra},
                         use_bin_type=True)


def _load(blob: bytes):
    return load_graph(blob, device=torch.device("cpu"), groups={"tp": "0"})


def _mm_graph(target="aten.mm.default", ref=0):
    return [
        {"name": "a", "op": "placeholder"},
        {"name": "b", "op": "placeholder"},
        {"name": "c", "op": "call_function", "target": target, "args": [{"$n": ref}, {"$n": 1}], "kwargs": {}},
        {"name": "output", "op": "output", "args": [{"$t": [{"$n": 2}]}]},
    ]


def test_well_formed_graph_runs():
    gm = _load(_blob(_mm_graph()))
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    (out,) = gm(a, b)
    assert torch.equal(out, a @ b)


@pytest.mark.parametrize("target", ["builtins.eval", "os.system", "aten.from_file.default", "subprocess.run.x",
                                    "torch.load", "aten.mm"])
def test_targets_outside_the_allow_list_are_refused(target):
    with pytest.raises(GraphFormatError):
        _load(_blob(_mm_graph(target=target)))


@pytest.mark.parametrize("ref", [2, 3, -1, "0"])
def test_forward_or_dangling_references_are_refused(ref):
    with pytest.raises(GraphFormatError):
        _load(_blob(_mm_graph(ref=ref)))


def test_unknown_process_group_is_refused():
    nodes = [
        {"name": "a", "op": "placeholder"},
        {"name": "r", "op": "call_function", "target": "_c10d_functional.all_reduce.default",
         "args": [{"$n": 0}, "sum", {"$group": "dp_shard"}], "kwargs": {}},
        {"name": "output", "op": "output", "args": [{"$t": [{"$n": 1}]}]},
    ]
    with pytest.raises(GraphFormatError, match="dp_shard"):
        _load(_blob(nodes))


@pytest.mark.parametrize("blob", [b"", b"\x00\x01garbage", msgpack.packb([1, 2, 3]),
                                  msgpack.packb({"format": "titan-graph", "version": 99, "nodes": []})])
def test_malformed_blobs_are_refused(blob):
    with pytest.raises(GraphFormatError):
        _load(blob)
