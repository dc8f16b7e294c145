"""The titan graph format (version 2): an FX graph as a msgpack node list, and its reader.

A graph blob is a msgpack map:
    {"format": "titan-graph", "version": 2, "nodes": [node, ...], "constants": bytes | null}
and each node is a map
    {"name": str, "op": "placeholder" | "call_function" | "get_attr" | "output",
     "target": str, "args": [value...], "kwargs": {str: value}, "val": meta, "module": str}
Values are msgpack scalars, lists, or one-key maps for what msgpack lacks:
    {"$n": i}        the output of node i (i < this node's index: graphs are acyclic)
    {"$t": [...]}    a tuple
    {"$dtype": s}    a torch dtype by name       {"$layout": s}  {"$mf": s} (memory format)
    {"$device": "local"}   the device the graph runs on
    {"$group": s}    the process group of mesh dimension s (e.g. "tp"), bound at load
    {"$bind": {"base": b, "coef": {dim: a, ...}}}   an integer bound at load from the loading
                     rank's mesh coordinates: b + sum(a * coordinate[dim]) (bindings.py)
`val` describes a node's result: {"shape", "stride", "dtype"} for a tensor, a list of those
for a tuple, {"int": n} for an integer, or null. Tensor constants (get_attr targets) are a
safetensors document embedded as bytes. Call targets are "<namespace>.<op>.<overload>" from the
explicit op allow-list (op_allowlist.py), or "getitem"; anything else is refused, so
loading runs no code. A node may carry "region": "<kind>#<n>", a fusion region tag, only of the
kinds the artifact's fusion pass makes (REGION_KINDS): a tag decides whether kernels are loaded.
"""

from __future__ import annotations

import math
import operator
import re
from typing import Any, Callable, Sequence

import safetensors.torch
import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from titan.runtime.contract.arg_bounds import (MAX_RANK, Meaning, check_arange, check_elements, check_meaning,  # noqa: F401
                                              meaning_of)
from titan.runtime.contract.bindings import bind_value
from titan.runtime.contract.graph_doc import (BIND, DEVICE, DTYPE, FORMAT, GROUP, LAYOUT, MAX_ELEMENTS,  # noqa: F401
                                             MAX_NODES, MEMORY_FORMAT, NODE, TUPLE, VERSION, GraphFormatError,
                                             read_doc)
from titan.runtime.contract.dtypes import DTYPE_NAMES
from titan.runtime.contract.node_fields import check_val
from titan.runtime.contract.op_allowlist import ALLOWED_OPS

# A fusion region tag: "<kind>#<n>"; runtime/kernels/fusion.py compiles each region.
REGION = re.compile(r"([a-z_]{1,16})#\d{1,6}")
# The region kinds each fusion pass makes: a graph may carry only the tags of the pass its
# manifest records (a tag added to a graph built without fusion is refused, not compiled).
REGION_KINDS = {
    "fuse_exact": frozenset({"exact"}),
    "fuse_regions": frozenset({"rms_norm", "rope", "swiglu", "loss"}),
    "fuse_blocks": frozenset({"block"}),
}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")
BUILTIN_TARGETS: dict[str, Callable] = {"getitem": operator.getitem}
_MODULE_ATTRIBUTES = frozenset(dir(torch.nn.Module()))
"""What a get_attr target may not name: the graph module's own attributes and methods."""


def target_name(target: Any) -> str:
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):
        ns, op = target._schema.name.split("::")
        return f"{ns}.{op}.{target._overloadname}"
    raise GraphFormatError(f"graph calls {target!r}, which the titan format cannot express")


def region_kinds(passes: Sequence[str]) -> frozenset[str]:
    """The region tags graphs built with `passes` (a manifest's, checked) may carry."""
    return frozenset().union(*(REGION_KINDS.get(p, frozenset()) for p in passes))


def resolve_target(name: str) -> Callable:
    if name in BUILTIN_TARGETS:
        return BUILTIN_TARGETS[name]
    if not isinstance(name, str) or name not in ALLOWED_OPS:
        raise GraphFormatError(f"op {str(name)[:120]!r} is not on titan's op allow-list (graph format {VERSION})")
    ns, op, overload = name.split(".")
    if ns == "titan":
        import titan.runtime.contract.ops  # noqa: F401  (registers the titan:: ops)
    try:
        packet = getattr(getattr(torch.ops, ns), op)
        return getattr(packet, overload)
    except (AttributeError, RuntimeError) as e:
        raise GraphFormatError(f"op {name!r} does not exist in torch {torch.__version__}") from e


_DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
_LAYOUTS = {"strided": torch.strided}
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "preserve_format": torch.preserve_format}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise GraphFormatError(f"unknown dtype {name!r}") from None


def _check_int(v: int, where: str) -> None:
    if abs(v) > MAX_ELEMENTS:
        raise GraphFormatError(f"{where}: integer {v} is beyond the allowed bound")


def _check_call(target: Callable, name: str, args: list, kwargs: dict, i: int, groups: dict[str, str]) -> None:
    """Arity and argument kinds against the op's schema; sizes within bounds; process groups only
    as the mesh dimensions this process bound (`groups`), never a literal group name."""
    if target is operator.getitem:
        if len(args) != 2 or kwargs or not isinstance(args[0], fx.Node) or not isinstance(args[1], int):
            raise GraphFormatError(f"node {i}: getitem takes (node, int)")
        outputs = args[0].meta.get("titan_val")
        if isinstance(outputs, list) and not 0 <= args[1] < len(outputs):
            raise GraphFormatError(f"node {i}: getitem index {args[1]} is outside the {len(outputs)} results")
        return
    positional, params = _signature(target)
    if len(args) > len(positional):
        raise GraphFormatError(f"node {i}: {name} takes {len(positional)} positional arguments, got {len(args)}")
    bound = dict(zip(positional, args))
    for k, v in kwargs.items():
        if k not in params or k in bound:
            raise GraphFormatError(f"node {i}: {name} has no argument {k!r} (or it is given twice)")
        bound[k] = v
    for arg, (kind, has_default, meaning) in params.items():
        if arg not in bound:
            if not has_default:
                raise GraphFormatError(f"node {i}: {name} is missing argument {arg!r}")
            continue
        where = f"node {i} ({name}) argument {arg}"
        _check_kind(bound[arg], kind, where)
        if meaning is not None:  # bounded by what it means (arg_bounds.py)
            check_meaning(meaning, bound[arg], where)
        _check_str_value(arg, bound[arg], where, groups)
    if target is _ARANGE or target is _ARANGE_START_STEP:
        check_arange(bound, f"node {i} ({name})")


_SIGNATURES: dict = {}


def _signature(target) -> tuple[tuple[str, ...], dict[str, tuple[str, bool, Meaning | None]]]:
    """(positional argument names, name -> (type string, has a default, meaning)) of an op's
    schema, read once per op: reading a schema through torch's bindings costs more than
    checking a call."""
    found = _SIGNATURES.get(target)
    if found is None:
        params = target._schema.arguments
        found = (tuple(a.name for a in params if not a.kwarg_only),
                 {a.name: (str(a.real_type), a.has_default_value(), meaning_of(a.name, str(a.real_type)))
                  for a in params})
        _SIGNATURES[target] = found
    return found


_ARANGE, _ARANGE_START_STEP = torch.ops.aten.arange.default, torch.ops.aten.arange.start_step


# String arguments take only these values: anything else fails inside torch at run time. A group
# name is never written as a literal: the graph names a mesh dimension ({"$group": "tp"}), and the
# name it decodes to is one this process bound.
_STR_VALUES = {"reduce_op": frozenset({"sum", "avg", "product", "min", "max", "band", "bor", "bxor"}),
               "side": frozenset({"left", "right"})}


class _BoundGroup(str):
    """A process-group name decoded from {"$group": dim}: the only kind of group_name accepted."""


def _check_str_value(arg: str, v, where: str, groups: dict[str, str]) -> None:
    if arg == "group_name" and not (isinstance(v, _BoundGroup) and v in groups.values()):
        raise GraphFormatError(f"{where}: a literal process group {str(v)[:40]!r}; a graph names its groups "
                               "by mesh dimension")
    if arg in _STR_VALUES and v is not None and v not in _STR_VALUES[arg]:
        raise GraphFormatError(f"{where}: {str(v)[:40]!r} is not one of {', '.join(sorted(_STR_VALUES[arg]))}")


_DECODED_KINDS = {"ScalarType": torch.dtype, "Layout": torch.layout, "Device": torch.device,
                  "MemoryFormat": torch.memory_format}


def _check_kind(v, kind: str, where: str) -> None:
    """`kind` is the schema's type string, e.g. 'Tensor', 'Optional[Tensor]', 'List[int]'."""
    optional = kind.startswith("Optional[")
    if optional:
        kind = kind[len("Optional["):-1]
    if v is None:
        if not optional:
            raise GraphFormatError(f"{where}: None for a {kind}")
        return
    if kind == "Tensor":
        # Traced graphs pass Python numbers where a schema says Tensor (wrapped scalars).
        ok = isinstance(v, (fx.Node, int, float, bool))
        if isinstance(v, int) and not isinstance(v, bool):
            _check_int(v, where)
    elif kind in ("List[Tensor]", "List[Optional[Tensor]]"):
        ok = isinstance(v, (list, tuple)) and all(x is None or isinstance(x, fx.Node) for x in v)
    elif kind in ("int", "SymInt"):
        ok = isinstance(v, int) and not isinstance(v, bool)
    elif kind in ("List[int]", "List[SymInt]"):
        ok = isinstance(v, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    elif kind == "float":
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    elif kind == "bool":
        ok = isinstance(v, bool)
    elif kind == "str":
        ok = isinstance(v, str)
    elif kind == "number":
        ok = isinstance(v, (int, float, bool))
    elif kind in _DECODED_KINDS:
        ok = isinstance(v, _DECODED_KINDS[kind])
    elif kind == "List[bool]":
        ok = isinstance(v, (list, tuple)) and all(isinstance(x, bool) for x in v)
    elif kind == "Any":
        ok = isinstance(v, (str, int, float, bool))
    else:
        raise GraphFormatError(f"{where}: arguments of type {kind} are not supported by the titan format")
    if not ok:
        raise GraphFormatError(f"{where}: expected {kind}, got {type(v).__name__}")


def _decode_value(v: Any, nodes: list[fx.Node], here: int, ctx: "_DecodeContext") -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [_decode_value(x, nodes, here, ctx) for x in v]
    if isinstance(v, dict) and len(v) == 1:
        (key, arg), = v.items()
        if key == NODE:
            if not isinstance(arg, int) or not 0 <= arg < here:
                raise GraphFormatError(f"node {here} refers to node {arg!r}, which is not an earlier node")
            return nodes[arg]
        if key == TUPLE:
            if not isinstance(arg, list):
                raise GraphFormatError(f"node {here}: malformed tuple")
            return tuple(_decode_value(x, nodes, here, ctx) for x in arg)
        if key == DTYPE:
            return dtype_from_name(arg)
        if key == DEVICE:
            if arg != "local":
                raise GraphFormatError(f"node {here}: device {arg!r} is not 'local'")
            return ctx.device
        if key == LAYOUT and arg in _LAYOUTS:
            return _LAYOUTS[arg]
        if key == MEMORY_FORMAT and arg in _MEMORY_FORMATS:
            return _MEMORY_FORMATS[arg]
        if key == GROUP:
            if arg not in ctx.groups:
                raise GraphFormatError(f"node {here}: process group {arg!r} is not a mesh dimension here "
                                       f"({', '.join(ctx.groups) or 'none'})")
            return _BoundGroup(ctx.groups[arg])
        if key == BIND:
            return bind_value(arg, ctx.coords, f"node {here}")
    raise GraphFormatError(f"node {here}: cannot decode value {v!r}")


class _DecodeContext:
    def __init__(self, device: torch.device, groups: dict[str, str], coords: dict[str, int] | None):
        self.device = device
        self.groups = groups
        self.coords = coords


def load_graph(blob: bytes, *, device: torch.device, groups: dict[str, str],
               regions: frozenset[str] = frozenset(), coords: dict[str, int] | None = None) -> fx.GraphModule:
    """Rebuild a GraphModule from a blob. `groups` maps mesh dimension names to the real
    process-group names of this process; `regions` are the fusion region kinds the graph may
    be tagged with (region_kinds of the manifest's passes); `coords` (this rank's coordinate on
    each mesh dimension) binds the program's rank-specific values."""
    doc = read_doc(blob)
    constants: dict[str, torch.Tensor] = {}
    if doc.get("constants") is not None:
        if not isinstance(doc["constants"], bytes):
            raise GraphFormatError("graph constants are not a safetensors document")
        try:
            constants = safetensors.torch.load(doc["constants"])
        except Exception as e:  # safetensors raises its own error types on bad input
            raise GraphFormatError(f"graph constants are unreadable: {e}") from e
    ctx = _DecodeContext(device, groups, coords)
    graph = fx.Graph()
    root = torch.nn.Module()
    nodes: list[fx.Node] = []
    records = doc["nodes"]
    if len(records) > MAX_NODES:
        raise GraphFormatError(f"graph has {len(records)} nodes, over the bound of {MAX_NODES}")
    names: set[str] = set()
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise GraphFormatError(f"node {i} is not a map")
        op = rec.get("op")
        args = _decode_value(rec.get("args", []), nodes, i, ctx)
        raw_kwargs = rec.get("kwargs") or {}
        if not isinstance(args, list) or not isinstance(raw_kwargs, dict):
            raise GraphFormatError(f"node {i}: args must be a list and kwargs a map")
        kwargs = {str(k): _decode_value(v, nodes, i, ctx) for k, v in raw_kwargs.items()}
        name = rec.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name) or name in names:
            raise GraphFormatError(f"node {i}: name {name!r} is not a unique identifier")
        names.add(name)
        if op == "placeholder":
            if args or raw_kwargs or (nodes and nodes[-1].op != "placeholder"):
                raise GraphFormatError(f"node {i}: placeholders come first and take no arguments")
            node = graph.placeholder(name)
        elif op == "call_function":
            target_str = rec.get("target", "")
            if not isinstance(target_str, str):
                raise GraphFormatError(f"node {i}: target is not a string")
            fn = resolve_target(target_str)
            _check_call(fn, target_str, args, kwargs, i, ctx.groups)
            node = graph.create_node("call_function", fn, tuple(args), kwargs, name=name)
        elif op == "get_attr":
            target = rec.get("target")
            if not isinstance(target, str) or not _NAME.fullmatch(target) or target not in constants:
                raise GraphFormatError(f"node {i}: constant {str(target)[:40]!r} is missing")
            if target in _MODULE_ATTRIBUTES:  # would read the module itself (a method, `training`), not a constant
                raise GraphFormatError(f"node {i}: constant {target!r} names an attribute of a module")
            if not hasattr(root, target):
                root.register_buffer(target, constants[target].to(device))
            node = graph.get_attr(target)
        elif op == "output":
            if i != len(records) - 1:
                raise GraphFormatError("output node is not last")
            if len(args) != 1 or not isinstance(args[0], (tuple, list)) or not all(
                    x is None or isinstance(x, fx.Node) for x in args[0]):
                raise GraphFormatError("output must be one tuple of nodes")
            node = graph.output(tuple(args[0]))
        else:
            raise GraphFormatError(f"node {i}: unknown op kind {op!r}")
        check_val(rec.get("val"), f"node {i}")
        node.meta["titan_val"] = rec.get("val")
        region = rec.get("region")
        if region is not None:
            m = REGION.fullmatch(region) if isinstance(region, str) else None
            if op != "call_function" or m is None or m.group(1) not in regions:
                raise GraphFormatError(f"node {i}: region {str(region)[:40]!r} is not a fusion region of the "
                                       f"passes this graph was built with")
            node.meta["titan_region"] = region
        nodes.append(node)
    if nodes[-1].op != "output":
        raise GraphFormatError("graph has no output node")
    # Lazy: the Python code is generated at the first call, not here. A graph that is only
    # checked (titan-verify's and the tools' loads, a redo program no step needs) never
    # generates it, and one whose regions are replaced by kernels generates it once, after
    # (runtime/kernels/fusion.py): code generation is a third of a 1B graph's load.
    return _LazyGraphModule(root, graph)
