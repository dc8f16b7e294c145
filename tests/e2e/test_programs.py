"""One program serves every rank of a layout; each rank binds its own values at load.

A value baked in from one rank shows only on the others, so these tests look at every rank:
the bound program of a rank that was not traced equals an independent trace of that rank, and
every rank trains bitwise equal to eager. (Fitting one program from probe ranks' traces, in
process: unit/test_program_fit.py.)"""

from __future__ import annotations

import json
from dataclasses import replace

import msgpack
import pytest
import torch

from conftest import assert_every_rank_equals_eager, titan
from titan.builder.program.bind import probe_ranks
from titan.runtime.contract.artifact import open_artifact
from titan.runtime.contract.bindings import bind_value
from titan.runtime.contract.graph_decode import load_graph, region_kinds
from titan.runtime.contract.graph_doc import BIND, GraphFormatError, read_doc
from titan.runtime.contract.layout import Layout


def _bound(value, coords: dict[str, int]):
    """A graph document's value with every binding replaced by its value at `coords`."""
    if isinstance(value, dict) and set(value) == {BIND}:
        return bind_value(value[BIND], coords, "test")
    if isinstance(value, dict):
        return {k: _bound(v, coords) for k, v in value.items()}
    if isinstance(value, list):
        return [_bound(v, coords) for v in value]
    return value


def _unnamed(doc: dict) -> dict:
    # Node names are labels FX numbers as it goes; everything else must match.
    return dict(doc, nodes=[{k: v for k, v in n.items() if k != "name"} for n in doc["nodes"]])


@pytest.mark.parametrize("layout", [dict(tp=4), dict(tp=2, dp_shard=2), dict(dp_replicate=2, dp_shard=2)],
                         ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_every_rank_of_a_layout_points_at_the_same_program(layout, debug_artifact):
    art = open_artifact(debug_artifact(**layout))
    world = art.world_size
    assert len(art.manifest.programs) == 1 and art.manifest.rank_programs == (0,) * world
    entries = [art.rank_entry(r) for r in range(world)]
    assert all(e == entries[0] for e in entries)
    assert not [rel for rel in art.manifest.files if rel.startswith("ranks/")], "no per-rank files"
    # What the runtime binds per rank: its coordinates, and which slice of each parameter it holds.
    for r in range(world):
        meta = art.rank_record(r)
        coords = Layout(**layout).coordinates(r)
        assert meta.coords == coords
        for p in meta.params:
            names = [d for d in ("tp", "dp_shard") if p.placements.get(d, "R").startswith("S")]
            assert [cut[2] for cut in p.slices] == [coords[d] for d in names]


def test_build_says_how_many_programs_it_traced(debug_artifact, tmp_path):
    r = titan("build", "--flavor", "debug", "--tp", 4, "--out", tmp_path / "again")
    assert r.returncode == 0, r.stderr
    assert "1 program for 4 ranks" in r.stdout.splitlines()[-1]


def test_bound_program_equals_an_independent_trace_of_an_untraced_rank(debug_artifact):
    """tp=4 traces the probe ranks 0, 1 and 3 (checked against their own traces at build
    time); rank 2 is bound only. Trace it on its own and compare every node."""
    from titan.builder.trace.pool import trace_in_processes
    from titan.builder.spec.build_spec import make_spec

    art = open_artifact(debug_artifact(tp=4))
    spec = make_spec(model="llama3", flavor="debug", tp=4, dp_shard=1, dp_replicate=1, batch_size=None, seq_len=None)
    assert probe_ranks(spec.layout) == [0, 1, 3]
    (traced,) = list(trace_in_processes(spec, [(2, (None,))], jobs=1, on_stage=lambda rank, stage: None))
    coords = art.rank_coordinates(2)
    bindings = 0
    for kind, blob in (("forward", traced.forward), ("backward", traced.backward)):
        program = read_doc(art.read_verified(getattr(art.rank_entry(2), kind)))
        bindings += json.dumps(program["nodes"]).count(BIND)
        assert _unnamed(_bound(program, coords)) == _unnamed(read_doc(blob)), kind
    assert bindings == 5  # embedding mask bounds and shift (3), two backward split indices
    stored = json.loads(art.read_verified(art.rank_entry(2).meta))
    bound = replace(art.rank_record(2), forward_graph=None, backward_graph=None)
    assert bound == traced.meta and stored["params"] != traced.meta.to_json()["params"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tp=4), dict(tp=2, dp_shard=2)], ids=["tp4", "tp2-dp_shard2"])
def test_every_rank_trains_bitwise_equal_to_eager(layout, debug_artifact, tmp_path):
    assert_every_rank_equals_eager(debug_artifact(**layout), tmp_path, steps=3, ranks=4)


def _program_blob(debug_artifact, kind: str) -> tuple[dict, bytes]:
    art = open_artifact(debug_artifact(tp=2))
    blob = art.read_verified(getattr(art.rank_entry(0), kind))
    return read_doc(blob), blob


def _rebind(doc: dict, change) -> bytes:
    for node in doc["nodes"]:
        for i, a in enumerate(node.get("args", [])):
            if isinstance(a, dict) and BIND in a:
                node["args"][i] = {BIND: change(a[BIND])}
                return msgpack.packb(doc, use_bin_type=True)
    raise AssertionError("no binding in the graph")


def test_runtime_refuses_forged_or_unbound_bindings(debug_artifact):
    cpu = torch.device("cpu")
    regions = region_kinds(open_artifact(debug_artifact(tp=2)).manifest.passes)
    doc, blob = _program_blob(debug_artifact, "forward")
    load_graph(blob, device=cpu, groups={"tp": "g"}, regions=regions, coords={"tp": 1})
    with pytest.raises(GraphFormatError, match="binds rank coordinates; load it for a rank"):
        load_graph(blob, device=cpu, groups={"tp": "g"}, regions=regions)
    forged = _rebind(doc, lambda b: {"base": b["base"], "coef": {"dp_shard": 1}})
    with pytest.raises(GraphFormatError, match="binding on 'dp_shard', which is not a mesh dimension here"):
        load_graph(forged, device=cpu, groups={"tp": "g"}, regions=regions, coords={"tp": 1})
    huge = _rebind(read_doc(blob), lambda b: {"base": 1 << 50, "coef": {}})
    with pytest.raises(GraphFormatError, match="not an integer within bounds"):
        load_graph(huge, device=cpu, groups={"tp": "g"}, regions=regions, coords={"tp": 1})
    # The backward's bindings pick this rank's slice of a split: an index past it is refused.
    bw_doc, _ = _program_blob(debug_artifact, "backward")
    past = _rebind(bw_doc, lambda b: {"base": 2, "coef": {}})
    with pytest.raises(GraphFormatError, match="getitem index 2 is outside the 2 results"):
        load_graph(past, device=cpu, groups={"tp": "g"}, regions=regions, coords={"tp": 0})


def test_run_refuses_a_rank_without_a_program(debug_artifact, tmp_path):
    import shutil
    art = tmp_path / "art"
    shutil.copytree(debug_artifact(tp=2), art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["rank_programs"] = [0, 1]
    (art / "manifest.json").write_text(json.dumps(manifest))
    r = titan("run", art, "--steps", 1)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error: manifest rank_programs[1]")
