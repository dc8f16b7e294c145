"""The graph format's allow-list covers every op titan-build emits (that it holds no
memory-unsafe op: unit/test_graph_format.py)."""

from __future__ import annotations

from titan.runtime.contract.artifact import open_artifact
from titan.runtime.contract.graph_doc import read_doc
from titan.runtime.contract.op_allowlist import ALLOWED_OPS


def test_allow_list_covers_every_op_titan_builds(debug_artifact):
    emitted = set()
    for art in (debug_artifact(), debug_artifact(tp=2)):
        a = open_artifact(art)
        for rel in a.manifest.files:
            if rel.startswith("graphs/"):
                emitted |= {n["target"] for n in read_doc(a.read_verified(rel))["nodes"] if n["op"] == "call_function"}
    assert emitted - {"getitem"} <= ALLOWED_OPS, emitted - ALLOWED_OPS
