"""The fields of a graph document's nodes that are data rather than calls, checked where a graph is
read: by the loader (graph_decode.py) and by the tools that print a graph without loading it
(titan-show, titan-diff). Torch-free.

A node's `val` describes its result (spec: graph_decode.py): a tensor {"shape", "stride",
"dtype"}, an integer {"int": n}, null, or a list of those for a tuple. Each number is bounded as
the graph's integers are and each dtype is a name from the one allow-list (dtypes.py): a stored
string never reaches getattr(torch, ...), and a shape never asks for more than one node's output bound (arg_bounds.py)."""

from __future__ import annotations

import re

from titan.runtime.contract.arg_bounds import MAX_RANK, check_elements
from titan.runtime.contract.dtypes import DTYPE_NAMES
from titan.runtime.contract.graph_doc import MAX_ELEMENTS, TUPLE, GraphFormatError, read_doc
MAX_RESULTS = 1 << 16
"""Most results one node's `val` lists."""
NODE_OPS = ("placeholder", "call_function", "get_attr", "output")
NODE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")
_TENSOR_KEYS = {"shape", "stride", "dtype"}


def _dims(v, what: str, where: str, *, lo: int) -> list[int]:
    if not isinstance(v, list) or len(v) > MAX_RANK or not all(
            isinstance(d, int) and not isinstance(d, bool) and lo <= d <= MAX_ELEMENTS for d in v):
        raise GraphFormatError(f"{where}: {what} {str(v)[:60]} is not a list of at most {MAX_RANK} integers "
                               f"in [{lo}, 2^34]")
    return v


def check_val(val, where: str) -> None:
    """GraphFormatError unless `val` is a well-formed, bounded result description."""
    stack = [val]
    while stack:
        v = stack.pop()
        if v is None:
            continue
        if isinstance(v, list):
            if len(v) > MAX_RESULTS:
                raise GraphFormatError(f"{where}: val lists {len(v)} results, over {MAX_RESULTS}")
            stack.extend(v)
        elif isinstance(v, dict) and set(v) == {"int"}:
            n = v["int"]
            if isinstance(n, bool) or not isinstance(n, int) or abs(n) > MAX_ELEMENTS:
                raise GraphFormatError(f"{where}: val integer {str(n)[:40]} is not an integer within 2^34")
        elif isinstance(v, dict) and set(v) == _TENSOR_KEYS:
            shape = _dims(v["shape"], "shape", where, lo=0)
            if len(_dims(v["stride"], "stride", where, lo=0)) != len(shape):
                raise GraphFormatError(f"{where}: stride and shape have different lengths")
            total = 1
            for d in shape:
                total *= d
            # Bounded as a node's output: the memory estimate (memory_estimate.py) and the tools read these.
            check_elements(total, f"{where}: recorded result")
            if v["dtype"] not in DTYPE_NAMES:
                raise GraphFormatError(f"{where}: dtype {str(v['dtype'])[:40]!r} is not one of {', '.join(DTYPE_NAMES)}")
        else:
            raise GraphFormatError(f"{where}: val {str(v)[:60]} is not a tensor, an integer, a tuple or null")


def check_node_fields(doc: dict) -> None:
    """Every node of a raw graph document (graph_doc.read_doc) has the fields a printer reads, of
    the right kinds: a map with an identifier name, a known op, a string target where it calls or
    reads, list args, map kwargs, a string module and region, a checked val."""
    for i, n in enumerate(doc["nodes"]):
        where = f"graph node {i}"
        if not isinstance(n, dict):
            raise GraphFormatError(f"{where} is not a map")
        if not isinstance(n.get("name"), str) or not NODE_NAME.fullmatch(n["name"]):
            raise GraphFormatError(f"{where}: name {str(n.get('name'))[:40]!r} is not an identifier")
        if n.get("op") not in NODE_OPS:
            raise GraphFormatError(f"{where}: unknown op kind {str(n.get('op'))[:40]!r}")
        if n["op"] in ("call_function", "get_attr") and not isinstance(n.get("target"), str):
            raise GraphFormatError(f"{where}: target is not a string")
        if not isinstance(n.get("args", []), list) or not isinstance(n.get("kwargs") or {}, dict):
            raise GraphFormatError(f"{where}: args must be a list and kwargs a map")
        for key in ("module", "region"):
            if n.get(key) is not None and not isinstance(n[key], str):
                raise GraphFormatError(f"{where}: {key} is not a string")
        if n["op"] == "output":
            args = n.get("args", [])
            outs = args[0] if len(args) == 1 else None
            if isinstance(outs, dict) and set(outs) == {TUPLE}:
                outs = outs[TUPLE]
            if i != len(doc["nodes"]) - 1 or not isinstance(outs, list):
                raise GraphFormatError(f"{where}: the output node must be last and return one tuple")
        check_val(n.get("val"), where)


def read_printable_doc(blob: bytes) -> dict:
    """A graph blob's document with every node's fields checked (check_node_fields): what the
    tools print, torch-free; GraphFormatError otherwise."""
    doc = read_doc(blob)
    check_node_fields(doc)
    return doc
