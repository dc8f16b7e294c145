"""Binding a program to one rank (spec: artifacts/README.md, "Programs and bindings").

A program's graphs and metadata name rank-specific values by the mesh coordinate they come
from; a rank binds them from its own coordinates, computed from its own rank and the layout,
never from anything the artifact says about the rank. Every bound value is range-checked.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan.runtime.contract.graph_doc import MAX_ELEMENTS, GraphFormatError

# Mesh dimensions that cut parameter slices, in the order the slices apply (tensor-parallel
# first, or expert-parallel for a model's routed experts, then FSDP on dim 0 of that slice).
SLICE_DIMS = ("tp", "ep", "dp_shard")


def _bounded_int(v, where: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or abs(v) > MAX_ELEMENTS:
        raise GraphFormatError(f"{where}: binding term {v!r} is not an integer within bounds")
    return v


@dataclass(kw_only=True, frozen=True)
class Binding:
    """An integer of a program bound at load (a graph value {"$bind": binding}): worth
    base + sum(coef[dim] * coordinate[dim]) at a rank's mesh coordinates."""
    base: int
    coef: dict[str, int]

    def to_json(self) -> dict:
        return {"base": self.base, "coef": self.coef}

    @staticmethod
    def from_json(spec, where: str) -> Binding:
        if not isinstance(spec, dict) or set(spec) != {"base", "coef"} or not isinstance(spec["coef"], dict):
            raise GraphFormatError(f"{where}: malformed binding {spec!r}")
        return Binding(base=_bounded_int(spec["base"], where),
                       coef={dim: _bounded_int(a, where) for dim, a in spec["coef"].items()})

    def value(self, coords: dict[str, int], where: str) -> int:
        value = self.base
        for dim, coef in self.coef.items():
            if dim not in coords:
                raise GraphFormatError(f"{where}: binding on {dim!r}, which is not a mesh dimension here "
                                       f"({', '.join(coords) or 'none'})")
            value += coef * coords[dim]
        return _bounded_int(value, where)


def bind_value(spec, coords: dict[str, int] | None, where: str) -> int:
    """The value of the binding `spec` (as a graph stores it) at `coords`, checked."""
    if coords is None:
        raise GraphFormatError(f"{where}: the graph binds rank coordinates; load it for a rank")
    return Binding.from_json(spec, where).value(coords, where)


def bound_params(params: list, coords: dict[str, int], sizes: dict[str, int], where: str) -> list:
    """The program's parameter table with each slice's mesh dimension replaced by this rank's
    coordinate on it (the slice index); a slice must cut its dimension into mesh-size parts."""
    out = []
    for p in params:
        if not isinstance(p, dict) or not isinstance(p.get("slices"), list):
            raise GraphFormatError(f"{where}: malformed parameter entry")
        slices = []
        for cut in p["slices"]:
            if (not isinstance(cut, list) or len(cut) != 3 or not isinstance(cut[2], str) or cut[2] not in SLICE_DIMS
                    or cut[2] not in sizes):
                raise GraphFormatError(f"{where}: parameter {str(p.get('fqn'))[:80]} slice {cut!r} is not cut by "
                                       "a sharded mesh dimension of this layout")
            if cut[1] != sizes[cut[2]]:
                raise GraphFormatError(f"{where}: parameter {str(p.get('fqn'))[:80]} slice {cut!r} does not cut "
                                       f"{cut[2]} into its {sizes[cut[2]]} coordinates")
            slices.append([cut[0], cut[1], coords[cut[2]]])
        out.append(dict(p, slices=slices))
    return out
