"""What one rank's step moves through collectives, read from an artifact's graphs: per
(collective, mesh dimension), how many and how many bytes, forward and backward together.

    python benchmarks/collective_volume.py ARTIFACT [--rank R] [--module-prefix layers.1.]

Bytes are the collective's full buffer as NCCL counts its size: the output of an all-gather,
an all-to-all and an all-reduce, the input (output x group size) of a reduce-scatter; a ring
moves about (n - 1) / n of it in and out of each rank (2 (n - 1) / n for an all-reduce).
`--module-prefix` keeps the collectives of one module (e.g. one MoE block, `layers.1.`).
Reads graph documents only (no torch import).
"""

from __future__ import annotations

import argparse
import math
from collections import Counter

from titan.runtime.contract.artifact import open_artifact
from titan.runtime.contract.graph_doc import GROUP
from titan.runtime.contract.node_fields import read_printable_doc

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "bool": 1}


def collectives(art, rank: int, prefix: str = "") -> tuple[Counter, Counter]:
    """(count, bytes) per (op, mesh dimension) over the rank's forward and backward graphs."""
    count, size = Counter(), Counter()
    sizes = art.layout.as_dict()
    for kind in ("forward", "backward"):
        nodes = read_printable_doc(art.read_verified(getattr(art.rank_entry(rank), kind)))["nodes"]
        for n in nodes:
            target = n.get("target", "")
            if not target.startswith("_c10d_functional.") or "wait_tensor" in target:
                continue
            if not (n.get("module") or "").startswith(prefix):
                continue
            op = target.split(".")[1]
            args = [*n.get("args", []), *(n.get("kwargs") or {}).values()]
            group = next(a[GROUP] for a in args if isinstance(a, dict) and GROUP in a)
            val = n["val"]
            nbytes = math.prod(val["shape"]) * BYTES[val["dtype"]]
            if op == "reduce_scatter_tensor":
                nbytes *= sizes[group]
            count[op, group] += 1
            size[op, group] += nbytes
    return count, size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--module-prefix", default="")
    args = p.parse_args()
    art = open_artifact(args.artifact)
    count, size = collectives(art, args.rank, args.module_prefix)
    print(f"{args.artifact}, rank {args.rank}{', modules ' + args.module_prefix if args.module_prefix else ''}: "
          "forward + backward")
    print("| collective | mesh dim | count | MiB |")
    print("|---|---|---|---|")
    for key in sorted(count):
        print(f"| {key[0]} | {key[1]} | {count[key]} | {size[key] / 2**20:.3f} |")
    print(f"| total | | {sum(count.values())} | {sum(size.values()) / 2**20:.3f} |")


if __name__ == "__main__":
    main()
