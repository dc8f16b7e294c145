"""One program for every rank of a layout (builder/program/bind.py), fitted in process from the probe
ranks' traces: a value that differs between ranks becomes a binding affine in the rank's mesh
coordinates, or the fit is refused. (Built artifacts and their ranks: e2e/test_programs.py.)"""

from __future__ import annotations

from dataclasses import replace

import msgpack
import pytest

from titan.builder.program.bind import NotOneProgram, one_program, probe_ranks
from titan.builder.trace.job import Trace
from titan.runtime.contract.graph_doc import BIND, FORMAT, VERSION, read_doc
from titan.runtime.contract.layout import Layout
from titan.runtime.contract.rank_record import RankRecord


def _doc(values: list) -> bytes:
    nodes = [{"name": "x", "op": "placeholder", "val": None}]
    nodes += [{"name": f"y{i}", "op": "call_function", "target": "aten.sub.Tensor", "args": [{"$n": 0}, v]}
              for i, v in enumerate(values)]
    return msgpack.packb({"format": FORMAT, "version": VERSION, "nodes": nodes, "constants": None})


def _traces(layout: Layout, value_of) -> list[Trace]:
    meta = RankRecord(params=(), forward_inputs=(), static_input_indices=(), saved_activations=0, saved_bytes=0,
                      backward_outputs=())
    return [Trace(rank=r, forward=_doc([value_of(layout.coordinates(r))]), backward=_doc([7]),
                  meta=replace(meta, rank=r, coords=layout.coordinates(r))) for r in probe_ranks(layout)]


def test_probe_ranks_fit_affine_bindings_and_refuse_anything_else():
    layout = Layout(dp_replicate=2, dp_shard=4, tp=8)
    assert probe_ranks(layout) == [0, 1, 8, 32, 63]
    program = one_program(layout, _traces(layout, lambda c: 1000 * c["tp"] - 3 * c["dp_shard"] + 5))
    assert program.bindings == 1
    node = read_doc(program.forward)["nodes"][1]
    assert node["args"][1] == {BIND: {"base": 5, "coef": {"dp_shard": -3, "tp": 1000}}}
    # Not affine in tp (right at 0 and 1, wrong at the last coordinate): refused, not guessed.
    with pytest.raises(NotOneProgram, match="not an affine function"):
        one_program(layout, _traces(layout, lambda c: c["tp"] ** 2))
    # Dimensions that do not add up (a product of coordinates): refused.
    with pytest.raises(NotOneProgram, match="not an affine function"):
        one_program(layout, _traces(layout, lambda c: c["tp"] * c["dp_shard"]))
