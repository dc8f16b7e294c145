"""The raw document of a titan graph blob: its format constants, the tags of its encoded values
(spec: graph_decode.py), and its reading without torch (for inspection tools)."""

from __future__ import annotations

import msgpack

from titan.runtime.common.safe_files import UnsafeFile, check_depth

FORMAT = "titan-graph"
VERSION = 2  # 2: integers bound from rank coordinates ({"$bind": ...})
# No integer in a graph or its metadata (sizes, counts) beyond this many elements (16 Gi: no
# rank of a 405B model at batch 8 x 8192 holds a tensor a tenth that size): a crafted artifact
# must not be able to ask for terabytes.
MAX_ELEMENTS = 1 << 34
MAX_DEPTH = 16
"""Deepest nesting of a graph document (titan writes at most 7 levels)."""
MAX_NODES = 1 << 20
MAX_GRAPH_BYTES = 64 << 20
"""Largest graph blob read: DeepSeek-V3 16B's backward is 1.5 MB, 671B's (61 layers) 5.1 MB."""
BYTES_PER_CONTAINER = 12
"""Every list or map of a graph document takes at least this many bytes of its blob on
average (titan's graphs: 20.5-22, Llama and DeepSeek-V3, with and without fusion): a document that decodes into more containers than
len(blob) / this is refused while decoding, before it expands (a blob of empty arrays, one
byte each, would otherwise make ~140 bytes of Python objects of every byte)."""
MAX_MAP_LEN = 64
"""Largest map (a node has 7 keys, a bind's coefficients one per mesh dimension)."""
MAX_STR_LEN = 4096
"""Longest string (names, op targets, module paths: titan writes at most ~100 characters)."""

# The one-key maps that encode what msgpack lacks (graph_encode.py writes them, graph_decode.py
# reads them, the tools print them).
NODE = "$n"
"""{"$n": i}: the output of node i."""
TUPLE = "$t"
DTYPE = "$dtype"
DEVICE = "$device"
LAYOUT = "$layout"
MEMORY_FORMAT = "$mf"
GROUP = "$group"
"""{"$group": dim}: the process group of a mesh dimension, bound at load."""
BIND = "$bind"
"""{"$bind": {"base": b, "coef": {dim: a}}}: an integer bound at load from the rank's coordinates."""


class GraphFormatError(ValueError):
    """A graph blob is malformed or refers to something outside the allow-list."""


class _ContainerBudget:
    """Counts the lists and maps msgpack builds (its hooks see each one as it is made) and stops
    the decoding when there are more than the blob's size allows."""

    def __init__(self, blob_len: int):
        self.left = blob_len // BYTES_PER_CONTAINER + 16

    def _spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise GraphFormatError(f"graph blob decodes into more than one list or map per {BYTES_PER_CONTAINER} "
                                   f"bytes; titan-build writes none like it")

    def list(self, items: list) -> list:
        self._spend()
        return items

    def map(self, pairs: list) -> dict:
        self._spend()
        return dict(pairs)


def read_doc(blob: bytes) -> dict:
    """The blob's msgpack document, checked for format and version (nodes are not validated).
    Sizes are bounded while it decodes: each string, byte string, list and map by what the
    format holds, and the number of lists and maps by the blob's size."""
    if len(blob) > MAX_GRAPH_BYTES:
        raise GraphFormatError(f"graph blob is {len(blob):,} bytes, over the bound of {MAX_GRAPH_BYTES:,}")
    budget = _ContainerBudget(len(blob))
    try:
        # msgpack's own stack bound (StackError) stops deeper documents before they are built.
        doc = msgpack.unpackb(blob, raw=False, strict_map_key=True, list_hook=budget.list,
                              object_pairs_hook=budget.map, max_str_len=MAX_STR_LEN, max_bin_len=len(blob),
                              max_array_len=MAX_NODES, max_map_len=MAX_MAP_LEN, max_ext_len=0)
    except GraphFormatError:
        raise
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise GraphFormatError(f"graph blob is not valid msgpack: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise GraphFormatError("blob is not a titan graph")
    if doc.get("version") != VERSION:
        raise GraphFormatError(f"graph format version {doc.get('version')!r}; this runtime reads version {VERSION}")
    if not isinstance(doc.get("nodes"), list) or not doc["nodes"]:
        raise GraphFormatError("graph has no nodes")
    try:
        check_depth(doc, MAX_DEPTH, "graph document")
    except UnsafeFile as e:
        raise GraphFormatError(str(e)) from None
    return doc
