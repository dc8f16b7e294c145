"""Programs: one forward/backward graph pair that serves every rank of a layout, with each
rank's own values (vocab shard bounds of the vocab-parallel embedding, the index of its slice
in backward splits, its parameter slices) bound when the rank loads it, from its coordinates.

Where the binding values come from matters: a value read from a Python rank call and baked
into a shared graph trains the other ranks wrong, silently (torchtitan #4730). So nothing here
guesses which values are rank-specific. The builder traces a few probe ranks for real, each in
its own process: rank 0 (every coordinate 0), for each mesh dimension the rank at coordinate 1
on it, and the far corner (every coordinate at its largest). Their graphs must be identical
but for integers; every integer that differs becomes a binding

    value = base + sum over mesh dims d of coef[d] * coordinate[d]

with `base` read from rank 0 and `coef[d]` from the unit probe of d, and the binding must
reproduce the traced value of every probe exactly (the corner checks that dimensions add up
and that the value is affine to the last coordinate). Tests compare the bound program of
every rank of small layouts with an independent trace of that rank.

When probes differ in anything else (structure, shapes, strings, floats), the ranks are not one
program: every rank is traced, and ranks with identical traces share one program (a class).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import msgpack

from titan.runtime.contract.bindings import SLICE_DIMS, Binding
from titan.runtime.contract.graph_doc import BIND, read_doc
from titan.runtime.contract.layout import Layout
from titan.builder.trace.job import Trace
from titan.runtime.contract.rank_record import RankRecord


class NotOneProgram(Exception):
    """The probe ranks' traces differ in more than integers that bind to coordinates."""


@dataclass(kw_only=True)
class Program:
    forward: bytes
    """Forward graph blob (with bindings)."""
    backward: bytes
    """Backward graph blob (with bindings)."""
    meta: RankRecord
    """Program metadata: the rank metadata with slice indices named by their mesh dimension."""
    bindings: int
    """Number of bound values in the two graphs."""


def rank_of(layout: Layout, coords: dict[str, int]) -> int:
    """Inverse of Layout.coordinates (row-major, tp innermost)."""
    rank = 0
    for name, size in layout.mesh_shape():
        rank = rank * size + coords.get(name, 0)
    return rank


def probe_ranks(layout: Layout) -> list[int]:
    """Rank 0, the rank at coordinate 1 of each mesh dimension, and the far corner."""
    dims = layout.mesh_shape()
    probes = [{}] + [{name: 1} for name, _ in dims]
    if dims:
        probes.append({name: size - 1 for name, size in dims})
    return sorted({rank_of(layout, c) for c in probes})


def same_value(a, b) -> bool:
    """Equal values of equal types (msgpack keeps True apart from 1; so do we)."""
    if type(a) is not type(b):
        return False
    # Loops, not all() over generators: this compares every value of every probe's graphs (a
    # deep model's build spends seconds here, issue 30).
    if isinstance(a, list):
        if len(a) != len(b):
            return False
        for x, y in zip(a, b):
            if not same_value(x, y):
                return False
        return True
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return False
        for k, x in a.items():
            if not same_value(x, b[k]):
                return False
        return True
    return a == b


class _Unifier:
    """Merges the same document of every probe into one, integers that differ into bindings."""

    def __init__(self, layout: Layout, traces: list[Trace]):
        self.dims = [name for name, _ in layout.mesh_shape()]
        self.coords = [layout.coordinates(t.rank) for t in traces]
        assert traces[0].rank == 0, "rank 0 is the first probe (the base of every binding)"
        self.unit = {d: next(i for i, c in enumerate(self.coords) if c[d] == 1 and sum(c.values()) == 1)
                     for d in self.dims}
        self.bindings = 0

    def merge(self, values: list, where: str):
        first = values[0]
        if all(same_value(first, v) for v in values[1:]):
            return first
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            return self._bind(values, where)
        if all(isinstance(v, list) for v in values) and len({len(v) for v in values}) == 1:
            return [self.merge([v[k] for v in values], f"{where}[{k}]") for k in range(len(first))]
        if all(isinstance(v, dict) for v in values) and all(v.keys() == first.keys() for v in values):
            return {k: self.merge([v[k] for v in values], f"{where}.{k}") for k in first}
        raise NotOneProgram(f"{where} differs between probe ranks beyond integers")

    def _bind(self, values: list[int], where: str) -> dict:
        base = values[0]
        coef = {d: values[self.unit[d]] - base for d in self.dims if values[self.unit[d]] != base}
        for v, c in zip(values, self.coords):
            if base + sum(a * c[d] for d, a in coef.items()) != v:
                raise NotOneProgram(f"{where} is not an affine function of the coordinates")
        self.bindings += 1
        return {BIND: Binding(base=base, coef=coef).to_json()}

    def graph(self, blobs: list[bytes], kind: str) -> bytes:
        """The probes' graphs as one; the traced bytes themselves when nothing binds."""
        docs = [read_doc(b) for b in blobs]
        before = self.bindings
        first = docs[0]
        if any(len(d["nodes"]) != len(first["nodes"]) or d.keys() != first.keys() for d in docs):
            raise NotOneProgram(f"the {kind} graphs of the probe ranks differ in structure")
        if any(d.get("constants") != first.get("constants") for d in docs):
            raise NotOneProgram(f"the {kind} graphs of the probe ranks have different tensor constants")
        nodes = []
        for i, node in enumerate(first["nodes"]):
            others = [d["nodes"][i] for d in docs]
            # Node names are labels (FX numbers them as it creates them); rank 0's are kept.
            plain = [{k: v for k, v in n.items() if k != "name"} for n in others]
            nodes.append(dict(self.merge(plain, f"{kind} node {i}"), name=node["name"]))
        if self.bindings == before:
            return blobs[0]
        return msgpack.packb(dict(first, nodes=nodes), use_bin_type=True)


def program_meta(meta: RankRecord, layout: Layout) -> RankRecord:
    """A rank's metadata without what only names the rank: its rank and coordinates, and the
    index of each parameter slice, replaced by the mesh dimension whose coordinate it is
    (checked: a slice that is not this rank's coordinate stops the program)."""
    coords = layout.coordinates(meta.rank)
    sizes = dict(layout.mesh_shape())
    params = []
    for p in meta.params:
        dims = [d for d in SLICE_DIMS if p.placements.get(d, "R").startswith("S")]
        if len(dims) != len(p.slices):
            raise NotOneProgram(f"parameter {p.fqn}: slices {[list(s) for s in p.slices]} do not follow its "
                                "placements")
        slices = []
        for (dim, parts, index), name in zip(p.slices, dims):
            if parts != sizes[name] or index != coords[name]:
                raise NotOneProgram(f"parameter {p.fqn}: slice {[dim, parts, index]} is not cut by the "
                                    f"{name} coordinate")
            slices.append((dim, parts, name))
        params.append(replace(p, slices=tuple(slices)))
    return replace(meta, rank=None, coords=None, params=tuple(params))


def one_program(layout: Layout, probes: list[Trace]) -> Program:
    """The program of every rank, from the probe ranks' traces; NotOneProgram if they differ
    in more than coordinate bindings."""
    metas = [program_meta(t.meta, layout) for t in probes]
    if any(not same_value(m.to_json(), metas[0].to_json()) for m in metas[1:]):
        raise NotOneProgram("the probe ranks' metadata differs beyond their coordinates")
    unifier = _Unifier(layout, probes)
    forward = unifier.graph([t.forward for t in probes], "forward")
    backward = unifier.graph([t.backward for t in probes], "backward")
    return Program(forward=forward, backward=backward, meta=metas[0], bindings=unifier.bindings)


def program_classes(layout: Layout, traces: list[Trace]) -> tuple[list[Program], list[int]]:
    """Without bindings: one program per set of ranks whose traces are identical; returns the
    programs and, per rank, its program's index."""
    programs: list[Program] = []
    index: dict[tuple, int] = {}
    assignment = []
    for t in sorted(traces, key=lambda t: t.rank):
        meta = program_meta(t.meta, layout)
        key = (t.forward, t.backward, msgpack.packb(meta.to_json()))
        if key not in index:
            index[key] = len(programs)
            programs.append(Program(forward=t.forward, backward=t.backward, meta=meta, bindings=0))
        assignment.append(index[key])
    return programs, assignment
