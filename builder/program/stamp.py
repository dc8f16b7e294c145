"""Deep programs from shallow traces: a Llama-style model repeats one transformer block, so its
program at depth n is its program at a small depth with (n - small) more copies of one block's
nodes, every integer in them (node references, layer indices in names and module paths, region
numbers, input indices) shifted by a fixed amount per block.

Tracing a 126-layer model costs minutes per trace; tracing it at depths 3, 4 and 5 costs
seconds. Three layers is the least that works: the first and the last layer differ from the
middle ones (the first's FSDP gather is not prefetched behind another block, the last has no
next block to prefetch), so a shallower model has no middle layer that repeats. titan-build
traces the probe ranks at those depths (builder/program/deep.py; builder/program/bind.py makes one
program per depth), fits every value of the program documents (graphs and metadata) as a
function of the depth, and evaluates the fit at the model's depth:

- a list that grows with depth (graph nodes of a kind, parameters, bucket records, graph
  outputs) grows by inserting a fixed run of elements per layer at one or more places; the
  elements outside the inserted runs are values of the depth n, the inserted ones values of
  their copy t (1-based) and of n;
- every other value is equal at all depths, or an integer (or a string's numbers) affine in
  n (and t): `base + a*n + b*t`, checked against every sample that was not used to fit it.

Nothing is assumed about which values repeat: a value that is not such a function stops the
fit (NotStampable). The fit is then checked against a real trace: evaluated at one depth past
the fitted ones (STAMP_CHECK_DEPTH), the program with every binding at rank 0's value must
equal rank 0's own trace at that depth, node for node (builder/program/deep.py). A model
whose fit fails there is traced at full depth instead, and the build says why.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any

from titan.builder.program.bind import same_value

STAMP_DEPTHS = (3, 4, 5)
"""The shallow depths every probe rank is traced at."""
STAMP_CHECK_DEPTH = 6
"""Rank 0 is also traced at this depth: the fit must reproduce that trace exactly."""

_NUMBER = re.compile(r"(\d+)")
# A graph's node list is fitted as three lists (inserted runs never cross from one to another).
_NODE_KINDS = ("placeholder", "body", "output")
_REF = "$n"
_TO = "$to"  # added to each node reference while fitting: what the referenced node is


class NotStampable(Exception):
    """The shallow programs do not extrapolate to deeper ones as one repeated block."""


Vars = dict[str, int]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# --- fitted values: evaluate(vars) gives the value at a depth (and block copy) -----------------


@dataclass(frozen=True, slots=True)
class _Const:
    value: Any

    def at(self, v: Vars):
        return self.value


@dataclass(frozen=True, slots=True)
class _Affine:
    base: int
    coef: tuple[tuple[str, int], ...]

    def at(self, v: Vars) -> int:
        return self.base + sum(c * v[name] for name, c in self.coef)


@dataclass(frozen=True, slots=True)
class _Text:
    parts: tuple  # str pieces and fitted numbers, alternating as re.split gives them

    def at(self, v: Vars) -> str:
        return "".join(p if isinstance(p, str) else str(p.at(v)) for p in self.parts)


@dataclass(frozen=True, slots=True)
class _List:
    items: tuple

    def at(self, v: Vars) -> list:
        return [x.at(v) for x in self.items]


@dataclass(frozen=True, slots=True)
class _Dict:
    items: tuple[tuple[str, Any], ...]

    def at(self, v: Vars) -> dict:
        return {k: x.at(v) for k, x in self.items}


@dataclass(frozen=True, slots=True)
class _Growing:
    """A list of runs: each fixed run is the same elements at every depth; each repeated run
    holds its elements once for every layer past `n0` (copy t = 1, 2, ...)."""

    runs: tuple[tuple[bool, tuple], ...]  # (repeated, fitted elements)
    n0: int

    def at(self, v: Vars) -> list:
        out = []
        for repeated, items in self.runs:
            if not repeated:
                out.extend(x.at(v) for x in items)
                continue
            for t in range(1, v["n"] - self.n0 + 1):
                vt = dict(v, t=t)
                out.extend(x.at(vt) for x in items)
        return out


# --- fitting ------------------------------------------------------------------------------------


def _fit_int(samples: list[tuple[Vars, int]], where: str) -> _Affine:
    names = sorted(samples[0][0])
    coef: dict[str, int] = {}
    for name in names:
        # Two samples that differ only in `name` give its coefficient.
        for va, a in samples:
            pair = next(((vb, b) for vb, b in samples if vb[name] != va[name]
                         and all(vb[o] == va[o] for o in names if o != name)), None)
            if pair is not None:
                step, rem = divmod(pair[1] - a, pair[0][name] - va[name])
                if rem:
                    raise NotStampable(f"{where}: not an integer step per layer")
                coef[name] = step
                break
        else:
            raise NotStampable(f"{where}: too few depths to fit its change along {name}")
    v0, x0 = samples[0]
    base = x0 - sum(c * v0[name] for name, c in coef.items())
    fit = _Affine(base, tuple((name, c) for name, c in coef.items() if c))
    for v, x in samples:
        if fit.at(v) != x:
            raise NotStampable(f"{where} is not an affine function of the depth")
    return fit


def fit(samples: list[tuple[Vars, Any]], where: str):
    """A fitted value reproducing every sample (vars -> value); NotStampable if none is."""
    first = samples[0][1]
    if all(same_value(first, x) for _, x in samples[1:]):
        return _Const(_without_annotations(first))
    values = [x for _, x in samples]
    if all(_is_int(x) for x in values):
        return _fit_int(samples, where)
    if all(isinstance(x, str) for x in values):
        split = [_NUMBER.split(x) for x in values]
        if len({len(s) for s in split}) != 1 or any(s[0::2] != split[0][0::2] for s in split):
            raise NotStampable(f"{where}: the text {first!r} changes beyond its numbers")
        parts = tuple(piece if i % 2 == 0 else _fit_int([(v, int(s[i])) for (v, _), s in zip(samples, split)], where)
                      for i, piece in enumerate(split[0]))
        return _Text(parts)
    if all(isinstance(x, dict) for x in values):
        if any(x.keys() != first.keys() for x in values):
            raise NotStampable(f"{where}: its keys change with the depth")
        return _Dict(tuple((k, fit([(v, x[k]) for v, x in samples], f"{where}.{k}")) for k in first if k != _TO))
    if all(isinstance(x, list) for x in values):
        if len({len(x) for x in values}) == 1:
            return _List(tuple(fit([(v, x[i]) for v, x in samples], f"{where}[{i}]") for i in range(len(first))))
        return _fit_growing(samples, where)
    raise NotStampable(f"{where} changes with the depth beyond integers")


def _without_annotations(value):
    if isinstance(value, dict):
        return {k: _without_annotations(v) for k, v in value.items() if k != _TO}
    if isinstance(value, list):
        return [_without_annotations(v) for v in value]
    return value


def _shape(x) -> Any:
    """What must match for two elements to be the same element of two depths: everything
    but node references and the numbers in text (both shift with the layers)."""
    if isinstance(x, dict):
        if _REF in x:
            return ("$n", x.get(_TO))
        return tuple((k, _shape(v)) for k, v in x.items())
    if isinstance(x, list):
        return tuple(_shape(v) for v in x)
    if isinstance(x, str):
        return _NUMBER.sub("#", x)
    return (type(x).__name__, x)


def _insertions(short: list, long: list, where: str) -> list[tuple[int, int]]:
    """Where `long` (one layer deeper) has elements that `short` lacks: [(index in short,
    count)], everything else equal by _shape.

    Within repeated layers an insertion can slide by whole elements and still match; each is
    put in the middle of the places it can be: the layers at either end of a model differ
    from the middle ones (the first prefetches, the last has no next), so of three layers
    the middle one is the one that repeats."""
    a, b = [hash(_shape(x)) for x in short], [hash(_shape(x)) for x in long]
    found = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op == "insert":
            found.append((i1, j1, j2 - j1))
        elif op != "equal":
            raise NotStampable(f"{where}: one layer deeper, elements change instead of only being added")
    sites = []
    for s, (i, j, count) in enumerate(found):
        left = found[s - 1][0] if s else 0
        right = found[s + 1][0] if s + 1 < len(found) else len(a)
        lo = i
        while lo > left and b[j - (i - lo) - 1] == b[j - (i - lo) - 1 + count]:
            lo -= 1
        hi = i
        while hi < right and b[j + (hi - i)] == b[j + (hi - i) + count]:
            hi += 1
        sites.append(((lo + hi) // 2, count))
    return sites


def _fit_growing(samples: list[tuple[Vars, Any]], where: str) -> _Growing:
    if any(set(v) != {"n"} for v, _ in samples):
        raise NotStampable(f"{where}: a list inside a repeated block grows with the depth")
    samples = sorted(samples, key=lambda s: s[0]["n"])
    (v0, x0), (v1, x1) = samples[0], samples[1]
    n0 = v0["n"]
    if v1["n"] != n0 + 1:
        raise NotStampable(f"{where}: needs consecutive depths")
    sites = _insertions(x0, x1, where)
    for v, x in samples:
        if len(x) != len(x0) + (v["n"] - n0) * sum(count for _, count in sites):
            raise NotStampable(f"{where}: does not grow by the same elements per layer")
    # Per run, per element: its samples (vars, value), read off each depth's list.
    bounds = [0] + [i for i, _ in sites] + [len(x0)]
    runs: list[tuple[bool, list[list]]] = []
    for s in range(len(sites) + 1):
        runs.append((False, [[] for _ in range(bounds[s], bounds[s + 1])]))
        if s < len(sites):
            runs.append((True, [[] for _ in range(sites[s][1])]))
    for v, x in samples:
        extra, pos = v["n"] - n0, 0
        for repeated, elements in runs:
            if not repeated:
                for k, el in enumerate(elements):
                    el.append((v, x[pos + k]))
                pos += len(elements)
                continue
            for t in range(1, extra + 1):
                for k, el in enumerate(elements):
                    el.append((dict(v, t=t), x[pos + k]))
                pos += len(elements)
    return _Growing(runs=tuple((repeated, tuple(fit(el, f"{where}[{'block' if repeated else 'at'} {r}.{k}]")
                                                for k, el in enumerate(elements)))
                               for r, (repeated, elements) in enumerate(runs)), n0=n0)


# --- documents ----------------------------------------------------------------------------------


def _annotate_refs(value, nodes: list[dict]):
    """`value` with each node reference saying what it refers to (op, target, value layout, module
    path without numbers): lists of bare references (graph outputs) align by what they hold."""
    if isinstance(value, dict):
        if _REF in value and len(value) == 1:
            to = nodes[value[_REF]]
            return {_REF: value[_REF], _TO: _shape([to.get("op"), to.get("target"), to.get("val"), to.get("module")])}
        return {k: _annotate_refs(v, nodes) for k, v in value.items()}
    if isinstance(value, list):
        return [_annotate_refs(v, nodes) for v in value]
    return value


def _split_nodes(doc: dict) -> dict:
    """A graph document with its node list as three lists that each grow at one place (and
    its node references annotated for alignment)."""
    nodes = [_annotate_refs(n, doc["nodes"]) for n in doc["nodes"]]
    kinds = {kind: [n for n in nodes if _kind(n) == kind] for kind in _NODE_KINDS}
    if [n for kind in _NODE_KINDS for n in kinds[kind]] != nodes:
        raise NotStampable("graph nodes are not placeholders, then the body, then the output")
    return dict(doc, nodes=kinds)


def _kind(node: dict) -> str:
    return node.get("op") if node.get("op") in ("placeholder", "output") else "body"


def _split_plan(meta: dict) -> dict:
    """Program metadata with the bucket plan as its forward and backward halves."""
    plan = meta.get("bucket_plan", [])
    halves = {g: [b for b in plan if b.get("graph") == g] for g in ("forward", "backward")}
    if halves["forward"] + halves["backward"] != plan:
        raise NotStampable("bucket plan: not the forward buckets, then the backward ones")
    return dict(meta, bucket_plan=halves)


@dataclass(frozen=True)
class StampedProgram:
    """A program fitted over depths: `at(n)` gives its forward, backward and metadata there."""

    forward: Any
    backward: Any
    meta: Any

    def at(self, n: int) -> tuple[dict, dict, dict]:
        v = {"n": n}
        fw, bw, meta = self.forward.at(v), self.backward.at(v), self.meta.at(v)
        join = lambda doc: dict(doc, nodes=[n for kind in _NODE_KINDS for n in doc["nodes"][kind]])  # noqa: E731
        plan = meta["bucket_plan"]
        return join(fw), join(bw), dict(meta, bucket_plan=plan["forward"] + plan["backward"])


def fit_program(depths: list[int], forwards: list[dict], backwards: list[dict], metas: list[dict]) -> StampedProgram:
    """Fit the program documents (graph documents as read_doc gives them, program metadata)
    of consecutive depths; NotStampable if they are not one block repeated."""
    if list(depths) != list(range(depths[0], depths[0] + len(depths))) or len(depths) < 3:
        raise NotStampable("needs three or more consecutive depths")
    vs = [{"n": d} for d in depths]
    return StampedProgram(
        forward=fit([(v, _split_nodes(d)) for v, d in zip(vs, forwards)], "forward"),
        backward=fit([(v, _split_nodes(d)) for v, d in zip(vs, backwards)], "backward"),
        meta=fit([(v, _split_plan(m)) for v, m in zip(vs, metas)], "metadata"))
