"""Semantic differences between two ranks' graphs (of one artifact or of two builds).

Ranks of one program share its graph blobs; what differs between them is the values each
binds from its coordinates (category "bindings": e.g. the vocab shard bounds of the
embedding mask, the index of its slice in a backward split), listed node by node.

Graphs are aligned by structure: the sequence of (op kind, target, module path) is matched
with a longest-common-subsequence alignment, so an inserted or removed node does not shift
every later comparison. Paired nodes are then compared argument by argument, with node
references followed through the alignment. Reads graph documents only (no torch import).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field

from titan.runtime.contract.artifact import Artifact
from titan.runtime.contract.bindings import bind_value
from titan.runtime.contract.graph_doc import BIND, GROUP, NODE
from titan.runtime.contract.node_fields import read_printable_doc
from titan.runtime.contract.rank_record import Bucket, RankRecord

CATEGORIES = ("manifest", "rank metadata", "static inputs", "bucket plan", "op targets", "inserted", "removed",
              "constants", "bindings", "shapes", "collectives", "wiring")
_C10D = "_c10d_functional."
# Manifest fields that say nothing about what was built.
# (Programs are compared through the ranks' graphs and metadata, not by their file names.)
_MANIFEST_IGNORED = {"files", "programs", "rank_programs", "created", "name", "cache_key"}
# Rank-record fields compared on their own, or (the graphs' digests) through the graphs.
_META_COMPARED = {"params", "bucket_plan", "static_input_indices", "forward_graph", "backward_graph"}


@dataclass
class Difference:
    where: str
    """'manifest', 'rank', 'forward' or 'backward'."""
    category: str
    """One of CATEGORIES."""
    detail: str
    """What differs, readable on one line."""
    node: str = ""
    """Node name (and index) in the first graph, or the second for inserted nodes."""
    module: str = ""
    """Module path that produced the node, if recorded."""

    def line(self) -> str:
        at = f" {self.node}" if self.node else ""
        mod = f" [{self.module}]" if self.module else ""
        return f"{self.where}{at}{mod}: {self.detail}"


@dataclass
class DiffReport:
    left: str
    right: str
    differences: list[Difference] = field(default_factory=list)
    same_blobs: dict[str, bool] = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        return not self.differences

    def summary(self) -> list[str]:
        lines = []
        for where in ("manifest", "rank", "forward", "backward"):
            here = [d for d in self.differences if d.where == where]
            if self.same_blobs.get(where) and not here:
                lines.append(f"{where}: identical (same blob)")
                continue
            if self.same_blobs.get(where):
                modules = sorted({d.module for d in here if d.module})
                lines.append(f"{where}: same program blob, {len(here)} bound values differ"
                             + (f" in {', '.join(modules[:8])}" if modules else ""))
                continue
            if not here:
                if where in ("forward", "backward") and where not in self.same_blobs:
                    continue
                lines.append(f"{where}: identical")
                continue
            counts = {c: sum(d.category == c for d in here) for c in CATEGORIES}
            parts = [f"{n} {c}" for c, n in counts.items() if n]
            modules = sorted({d.module for d in here if d.module})
            mod = f" in {', '.join(modules[:8])}{' ...' if len(modules) > 8 else ''}" if modules else ""
            lines.append(f"{where}: {', '.join(parts)}{mod}")
        return lines

    def as_json(self) -> dict:
        return {"left": self.left, "right": self.right, "identical": self.identical,
                "summary": self.summary(), "same_blobs": self.same_blobs,
                "differences": [d.__dict__ for d in self.differences]}


def _short(v) -> str:
    text = json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _dict_diff(a: dict, b: dict, where: str, category: str, prefix: str = "") -> list[Difference]:
    out = []
    for key in sorted(set(a) | set(b), key=str):
        x, y = a.get(key, "<absent>"), b.get(key, "<absent>")
        if x == y:
            continue
        if isinstance(x, dict) and isinstance(y, dict):
            out += _dict_diff(x, y, where, category, f"{prefix}{key}.")
        elif _str_list(x) and _str_list(y) and set(x) != set(y):
            change = [f"-{v}" for v in x if v not in y] + [f"+{v}" for v in y if v not in x]
            out.append(Difference(where, category, f"{prefix}{key}: {' '.join(change)}"))
        else:
            out.append(Difference(where, category, f"{prefix}{key}: {_short(x)} -> {_short(y)}"))
    return out


def _bucket_key(b: Bucket) -> tuple:
    return (b.graph, b.kind, b.group, b.block)


def _bucket_text(b: Bucket) -> str:
    return (f"{b.graph} {b.kind.replace('_', '-')} bucket on {b.group} for {b.block}: "
            f"{len(b.params)} params, {b.elements:,} elements {b.dtype}")


def _plan_diff(a: list[Bucket], b: list[Bucket]) -> list[Difference]:
    ka, kb = {_bucket_key(x): x for x in a}, {_bucket_key(x): x for x in b}
    out = []
    for key in [k for k in ka if k not in kb]:
        out.append(Difference("rank", "bucket plan", f"removed {_bucket_text(ka[key])}", module=key[3]))
    for key in [k for k in kb if k not in ka]:
        out.append(Difference("rank", "bucket plan", f"added {_bucket_text(kb[key])}", module=key[3]))
    for key in [k for k in ka if k in kb and ka[k] != kb[k]]:
        x, y = ka[key].to_json(), kb[key].to_json()
        changed = [f"{f}: {_short(x[f])} -> {_short(y[f])}" for f in sorted(x) if x[f] != y[f]]
        out.append(Difference("rank", "bucket plan", f"changed {_bucket_text(ka[key])}: {'; '.join(changed)}",
                              module=key[3]))
    return out


def _param_order(fqn: str) -> tuple:
    """Parameters in model order: layers by number."""
    return tuple(int(p) if p.isdigit() else p for p in fqn.split("."))


def _meta_diff(ra: RankRecord, rb: RankRecord) -> list[Difference]:
    pa, pb = ({p.fqn: p.to_json() for p in r.params} for r in (ra, rb))
    out = _plan_diff(list(ra.bucket_plan), list(rb.bucket_plan))
    sa, sb = list(ra.static_input_indices), list(rb.static_input_indices)
    if sa != sb:
        out.append(Difference("rank", "static inputs", f"static input indices: {_short(sa)} -> {_short(sb)}"))
    # The rest of the record, field by field in its JSON form.
    a, b = ({k: v for k, v in r.to_json().items() if k not in _META_COMPARED} for r in (ra, rb))
    out += _dict_diff(a, b, "rank", "rank metadata")
    changes = []
    for fqn in sorted(set(pa) | set(pb), key=_param_order):
        x, y = pa.get(fqn), pb.get(fqn)
        if x is None or y is None:
            out.append(Difference("rank", "rank metadata", f"param {fqn} {'added' if x is None else 'removed'}"))
        elif x != y:
            changes += [(d.detail.split(": ", 1)[1], fqn, d) for d in _dict_diff(x, y, "rank", "rank metadata", "")]
    # One line per distinct change (e.g. every tp-sharded parameter moving to this rank's slice).
    by_change: dict[str, list] = {}
    for change, fqn, d in changes:
        by_change.setdefault(f"{d.detail.split(':', 1)[0]}: {change}", []).append(fqn)
    for change, fqns in by_change.items():
        field, what = change.split(": ", 1)
        names = ", ".join(fqns[:3]) + (f", ... ({len(fqns)} params)" if len(fqns) > 3 else "")
        out.append(Difference("rank", "rank metadata", f"params {field}: {what} for {names}"))
    return out


def _sig(n: dict) -> tuple:
    return (n.get("op"), n.get("target"), n.get("module", ""))


def _is_collective(n: dict) -> bool:
    t = n.get("target") or ""
    return t.startswith(_C10D) and not t.startswith(_C10D + "wait_tensor")


def _describe(n: dict) -> str:
    kind = n.get("target") or n.get("op")
    val = n.get("val")
    if isinstance(val, dict) and "shape" in val:
        kind += f" -> {val['dtype']}{val['shape']}"
    if _is_collective(n):
        groups = [a[GROUP] for a in n.get("args", []) if isinstance(a, dict) and GROUP in a]
        kind += f" on {','.join(groups)}"
    return kind


def _is_bind(v) -> bool:
    return isinstance(v, dict) and len(v) == 1 and BIND in v


class _GraphDiff:
    def __init__(self, where: str, a: list[dict], b: list[dict], coords_a: dict, coords_b: dict):
        self.where, self.a, self.b = where, a, b
        self.coords_a, self.coords_b = coords_a, coords_b
        self.map: dict[int, int] = {}
        self.out: list[Difference] = []

    def _node(self, i: int, nodes: list[dict]) -> str:
        return f"%{i} {nodes[i].get('name', '')}"

    def _add(self, category: str, detail: str, i: int, nodes: list[dict]) -> None:
        self.out.append(Difference(self.where, category, detail, self._node(i, nodes), nodes[i].get("module", "")))

    def run(self) -> list[Difference]:
        pairs = []
        if self.a is self.b:  # one program: node i is node i
            opcodes = [("equal", 0, len(self.a), 0, len(self.b))]
        else:
            opcodes = difflib.SequenceMatcher(a=[_sig(n) for n in self.a], b=[_sig(n) for n in self.b],
                                              autojunk=False).get_opcodes()
        for tag, i1, i2, j1, j2 in opcodes:
            if tag == "equal" or (tag == "replace" and i2 - i1 == j2 - j1):
                for k in range(i2 - i1):
                    self.map[i1 + k] = j1 + k
                    pairs.append((i1 + k, j1 + k))
                continue
            for i in range(i1, i2):
                self._add("collectives" if _is_collective(self.a[i]) else "removed",
                          f"removed {_describe(self.a[i])}", i, self.a)
            for j in range(j1, j2):
                self._add("collectives" if _is_collective(self.b[j]) else "inserted",
                          f"inserted {_describe(self.b[j])}", j, self.b)
        for i, j in pairs:
            self._compare(i, j)
        return self.out

    def _compare(self, i: int, j: int) -> None:
        x, y = self.a[i], self.b[j]
        if x.get("target") != y.get("target") or x.get("op") != y.get("op"):
            category = "collectives" if _is_collective(x) or _is_collective(y) else "op targets"
            self._add(category, f"{x.get('target') or x.get('op')} -> {y.get('target') or y.get('op')}", i, self.a)
        if x.get("val") != y.get("val"):
            self._add("shapes", f"{_short(x.get('val'))} -> {_short(y.get('val'))}", i, self.a)
        self._args(x.get("args", []), y.get("args", []), i, "arg ")
        kx, ky = x.get("kwargs") or {}, y.get("kwargs") or {}
        for k in sorted(set(kx) | set(ky)):
            self._args(kx.get(k), ky.get(k), i, f"{k}=")

    def _args(self, u, v, i: int, path: str) -> None:
        if _is_bind(u) or _is_bind(v):
            x = bind_value(u[BIND], self.coords_a, path) if _is_bind(u) else u
            y = bind_value(v[BIND], self.coords_b, path) if _is_bind(v) else v
            if x != y:
                self._add("bindings", f"{path}: binds {_short(x)} -> {_short(y)}", i, self.a)
            return
        if isinstance(u, list) and isinstance(v, list) and len(u) == len(v):
            for k, (p, q) in enumerate(zip(u, v)):
                self._args(p, q, i, f"{path}{k}" if path.endswith(" ") else f"{path}[{k}]")
            return
        if isinstance(u, dict) and isinstance(v, dict) and len(u) == len(v) == 1 and u.keys() == v.keys():
            (key,) = u.keys()
            if key == NODE:
                if self.map.get(u[key]) != v[key]:
                    self._add("wiring", f"{path}: %{u[key]} -> %{v[key]} (inputs differ)", i, self.a)
                return
            if key == GROUP:
                if u != v:
                    self._add("collectives", f"regrouped {path}: {u[key]} -> {v[key]}", i, self.a)
                return
            self._args(u[key], v[key], i, path)
            return
        if u != v:
            self._add("constants", f"{path}: {_short(u)} -> {_short(v)}", i, self.a)


def diff_ranks(left: Artifact, left_rank: int, right: Artifact, right_rank: int, *,
               graphs: tuple[str, ...] = ("forward", "backward")) -> DiffReport:
    report = DiffReport(left=f"{left.root} rank {left_rank}", right=f"{right.root} rank {right_rank}")
    if left.root != right.root:
        ma = {k: v for k, v in left.manifest.to_json().items() if k not in _MANIFEST_IGNORED}
        mb = {k: v for k, v in right.manifest.to_json().items() if k not in _MANIFEST_IGNORED}
        report.differences += _dict_diff(ma, mb, "manifest", "manifest")
    rank_differences = _meta_diff(left.rank_record(left_rank), right.rank_record(right_rank))
    ea, eb = left.rank_entry(left_rank), right.rank_entry(right_rank)
    ca, cb = left.rank_coordinates(left_rank), right.rank_coordinates(right_rank)
    for kind in graphs:
        ha, hb = left.graph_hash(left_rank, kind), right.graph_hash(right_rank, kind)
        report.same_blobs[kind] = ha == hb
        a = read_printable_doc(left.read_verified(getattr(ea, kind)))
        # One program: the same nodes, compared for the values each rank binds.
        b = a if ha == hb else read_printable_doc(right.read_verified(getattr(eb, kind)))
        report.differences += _GraphDiff(kind, a["nodes"], b["nodes"], ca, cb).run()
        if a.get("constants") != b.get("constants"):
            report.differences.append(Difference(kind, "constants", "tensor constants differ"))
    report.differences += rank_differences  # after the graphs: what a reader looks for first
    return report
