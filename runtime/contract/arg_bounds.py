"""What each integer argument of an allowed op means, and the bound that meaning gives it.

A graph's integers are untrusted: the loader bounds every one before any op runs. One bound
for all of them is wrong both ways: a list of split sizes adds (four splits of 512 rows are
2,048 rows, not 512^4 elements: issue 32, where the product refused every DeepSeek-V3
artifact above ep 2), a shape multiplies, a dimension index is tiny. So each argument is
bounded by what it means, read from the op's schema: its name and type (`SymInt[] size` is a
shape, `SymInt[] output_split_sizes` a split list, `int dim` a dimension). Every int, int
list and number argument of every allowed op has a meaning here; tests/test_graph_format.py
fails for an allowed op with one that has none, and the loader refuses it.

Sizes that become a node's output (a shape to create or view, a split list's rows, an
arange's length) are bounded by MAX_NODE_ELEMENTS, far below the format's MAX_ELEMENTS.
"""

from __future__ import annotations

import math
from enum import Enum

from titan.runtime.contract.graph_doc import MAX_ELEMENTS, GraphFormatError

MAX_RANK = 8
"""Tensors have at most this many dimensions; `dim` arguments are bounded by it."""
MAX_NODE_ELEMENTS = 1 << 33
"""Most elements one node's output may have: 8 Gi (32 GiB in fp32; the format's MAX_ELEMENTS
is twice that). The largest tensor titan builds, DeepSeek-V3 671B's dropless dispatch buffer at
tp 8 x ep 64 x dp-shard 4, batch 1 x 8192, is 262,145 x 7,168 = 1.9 Gi (measured 2026-11-25);
Llama-3 405B's logits at batch 8 x 8192, tp 8, 1 Gi. What a device can hold is checked before
the first step (runtime/contract/memory_estimate.py)."""
MAX_SPLITS = 1 << 16
"""Most parts of a split list: a process group has at most 2^16 ranks."""


class Meaning(Enum):
    SHAPE = "shape"
    """A tensor shape (a view's or a created tensor's): each size >= -1 (-1: inferred or
    kept), at most MAX_RANK of them, the product at most MAX_NODE_ELEMENTS."""
    SPLITS = "split sizes"
    """Sizes of consecutive parts of one dimension: each >= 0, at most MAX_SPLITS, the sum at
    most MAX_NODE_ELEMENTS."""
    DIMS = "dimension list"
    """Dimension indices: at most MAX_RANK, each in [-MAX_RANK, MAX_RANK)."""
    PADDING = "padding"
    """(before, after) pairs per dimension, from the last: at most 2 * MAX_RANK, each at most
    MAX_NODE_ELEMENTS in size (negative: cropping)."""
    DIM = "dimension"
    """One dimension index, in [-MAX_RANK, MAX_RANK)."""
    GROUP_SIZE = "group size"
    """Ranks of a process group: [1, MAX_SPLITS]."""
    COUNT = "count"
    """A number of elements or rows to make: [0, MAX_NODE_ELEMENTS]."""
    STEP = "step"
    """A stride through a dimension: [1, MAX_ELEMENTS]."""
    POSITION = "position"
    """An index into a dimension (negative: from its end): |v| <= MAX_ELEMENTS."""
    REDUCTION = "reduction"
    """A loss reduction: 0 (none), 1 (mean) or 2 (sum)."""
    SCALAR = "scalar"
    """A value computed with (a fill, an operand, a clamp bound): an integer |v| <=
    MAX_ELEMENTS, or any float."""


# (argument name, schema type) -> meaning. Types are torch's schema strings with Optional[]
# removed; SymInt and int are read the same (a stored graph holds plain integers).
MEANINGS: dict[tuple[str, str], Meaning] = {
    ("size", "List[int]"): Meaning.SHAPE,
    ("input_sizes", "List[int]"): Meaning.SHAPE,
    ("split_sizes", "List[int]"): Meaning.SPLITS,
    ("output_split_sizes", "List[int]"): Meaning.SPLITS,
    ("input_split_sizes", "List[int]"): Meaning.SPLITS,
    ("dim", "List[int]"): Meaning.DIMS,
    ("pad", "List[int]"): Meaning.PADDING,
    ("dim", "int"): Meaning.DIM,
    ("dim0", "int"): Meaning.DIM,
    ("dim1", "int"): Meaning.DIM,
    ("group_size", "int"): Meaning.GROUP_SIZE,
    ("num_weights", "int"): Meaning.COUNT,
    ("k", "int"): Meaning.COUNT,
    ("split_size", "int"): Meaning.COUNT,
    ("step", "int"): Meaning.STEP,
    ("index", "int"): Meaning.POSITION,
    ("start", "int"): Meaning.POSITION,
    ("end", "int"): Meaning.POSITION,
    ("padding_idx", "int"): Meaning.POSITION,
    ("ignore_index", "int"): Meaning.POSITION,
    ("reduction", "int"): Meaning.REDUCTION,
    # Scalars ("number"): arange's start / end / step are checked together (check_arange).
    **{(name, "number"): Meaning.SCALAR for name in (
        "alpha", "other", "value", "exponent", "s", "self", "min", "max", "start", "end", "step")},
}
BOUNDED_KINDS = ("int", "List[int]", "number")
"""Schema types whose values carry sizes: each argument of one of these needs a meaning."""
_INT_LIST_KINDS = ("List[int]", "List[SymInt]")


def plain_kind(kind: str) -> str:
    """'Optional[List[SymInt]]' -> 'List[int]': the type a meaning is looked up by."""
    if kind.startswith("Optional["):
        kind = kind[len("Optional["):-1]
    return "int" if kind == "SymInt" else "List[int]" if kind in _INT_LIST_KINDS else kind


def meaning_of(arg: str, kind: str) -> Meaning | None:
    """The meaning of argument `arg` of schema type `kind`; None for one that carries no size
    (a tensor, a bool, a dtype, a string)."""
    kind = plain_kind(kind)
    if kind not in BOUNDED_KINDS:
        return None
    found = MEANINGS.get((arg, kind))
    if found is None:
        raise GraphFormatError(f"argument {arg} ({kind}) has no known meaning, so no bound; "
                               f"titan's loader cannot check it (graph format)")
    return found


def _fail(where: str, what: str):
    raise GraphFormatError(f"{where}: {what}")


def _in(v: int, lo: int, hi: int, where: str, what: str) -> None:
    if not lo <= v <= hi:
        _fail(where, f"{what} {v} is outside [{lo}, {hi}]")


def check_meaning(meaning: Meaning, v, where: str) -> None:
    """`v` (already of its schema type; None for an omitted optional) within its meaning's bound."""
    if v is None:
        return
    if meaning is Meaning.SCALAR:
        if isinstance(v, int) and not isinstance(v, bool):
            _in(v, -MAX_ELEMENTS, MAX_ELEMENTS, where, "integer")
        return
    if isinstance(v, (list, tuple)):
        _check_list(meaning, list(v), where)
        return
    if meaning is Meaning.DIM:
        _in(v, -MAX_RANK, MAX_RANK - 1, where, "dimension")
    elif meaning is Meaning.GROUP_SIZE:
        _in(v, 1, MAX_SPLITS, where, "group size")
    elif meaning is Meaning.COUNT:
        _in(v, 0, MAX_NODE_ELEMENTS, where, "count")
    elif meaning is Meaning.STEP:
        _in(v, 1, MAX_ELEMENTS, where, "step")
    elif meaning is Meaning.POSITION:
        _in(v, -MAX_ELEMENTS, MAX_ELEMENTS, where, "position")
    elif meaning is Meaning.REDUCTION:
        _in(v, 0, 2, where, "reduction")
    else:
        _fail(where, f"a single integer where a {meaning.value} is expected")


def _check_list(meaning: Meaning, v: list[int], where: str) -> None:
    if meaning is Meaning.SHAPE:
        if len(v) > MAX_RANK:
            _fail(where, f"shape of {len(v)} dimensions (at most {MAX_RANK})")
        for d in v:
            _in(d, -1, MAX_NODE_ELEMENTS, where, "size")
        check_elements(math.prod(max(d, 1) for d in v), where)
    elif meaning is Meaning.SPLITS:
        if len(v) > MAX_SPLITS:
            _fail(where, f"{len(v)} split sizes (at most {MAX_SPLITS})")
        for d in v:
            _in(d, 0, MAX_NODE_ELEMENTS, where, "split size")
        if sum(v) > MAX_NODE_ELEMENTS:
            _fail(where, f"split sizes add up to {sum(v)}, over the bound of {MAX_NODE_ELEMENTS}")
    elif meaning is Meaning.DIMS:
        if len(v) > MAX_RANK:
            _fail(where, f"{len(v)} dimensions (at most {MAX_RANK})")
        for d in v:
            _in(d, -MAX_RANK, MAX_RANK - 1, where, "dimension")
    elif meaning is Meaning.PADDING:
        if len(v) > 2 * MAX_RANK or len(v) % 2:
            _fail(where, f"padding of {len(v)} values (pairs, at most {MAX_RANK})")
        for d in v:
            _in(d, -MAX_NODE_ELEMENTS, MAX_NODE_ELEMENTS, where, "padding")
    else:
        _fail(where, f"a list where a {meaning.value} is expected")


def check_elements(n: int, where: str) -> None:
    """A node's output (or a shape it names) of `n` elements is within MAX_NODE_ELEMENTS."""
    if n > MAX_NODE_ELEMENTS:
        _fail(where, f"{n:,} elements, over the bound of {MAX_NODE_ELEMENTS:,} for one node's output")


def check_arange(bound: dict, where: str) -> None:
    """aten.arange's length, from its start / end / step: at most MAX_NODE_ELEMENTS."""
    start, end, step = bound.get("start", 0), bound["end"], bound.get("step", 1)
    length = (end - start) / step if step else math.nan  # inf or nan for values no arange takes
    if not math.isfinite(length):
        _fail(where, "arange needs finite start, end and a non-zero step")
    check_elements(max(0, math.ceil(length)), where)
