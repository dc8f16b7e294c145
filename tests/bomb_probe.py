"""Feed one untrusted input to the loader in a fresh process and report what it cost (tests
start it, one input per process, so that peak memory is this input's alone).

    python bomb_probe.py graph FILE | manifest DIR | program DIR | good DIR | plain-msgpack FILE | plain-json FILE

Prints one JSON line: {"error": the loader's message or null, "peak_mib": the growth of this
process's peak resident memory while loading}. The input's bytes are read before the
baseline is taken (reading them is bounded by the file size bound); `plain-*` decode them as
the loader did before it bounded them while decoding (for comparison, not for the tests)."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import msgpack
import torch

from titan.runtime.contract.artifact import ArtifactError, open_artifact
from titan.runtime.contract.graph_decode import GraphFormatError, load_graph
from titan.runtime.rank_graphs import check_rank_loads


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    kind, path = sys.argv[1], Path(sys.argv[2])
    data = path.read_bytes() if path.is_file() else None
    loads = {
        "graph": lambda: load_graph(data, device=torch.device("cpu"), groups={}),
        "plain-msgpack": lambda: msgpack.unpackb(data, raw=False, strict_map_key=True),
        "plain-json": lambda: json.loads(data),
        "manifest": lambda: open_artifact(path),
        "program": lambda: open_artifact(path).rank_record(0),
        "good": lambda: [check_rank_loads(art, r) for art in [open_artifact(path)] for r in range(art.world_size)],
    }
    open_artifact  # noqa: B018  (imported before the baseline, as everything the load needs)
    before = peak_mib()
    error = None
    try:
        loads[kind]()
    except (GraphFormatError, ArtifactError) as e:
        error = str(e)
    print(json.dumps({"error": error, "peak_mib": round(peak_mib() - before, 1)}))


if __name__ == "__main__":
    main()
