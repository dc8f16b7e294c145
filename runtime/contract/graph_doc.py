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


def read_doc(blob: bytes) -> dict:
    """The blob's msgpack document, checked for format and version (nodes are not validated)."""
    try:
        # msgpack's own stack bound (StackError) stops deeper documents before they are built.
        doc = msgpack.unpackb(blob, raw=False, strict_map_key=True)
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
