"""A pipeline's middle stages without tracing each one: stages that hold the same number of
blocks and neither the embedding nor the output (15 of 405B's 16 at pp 16) compute the same
graphs on different layers. Their programs differ only in the layer index inside parameter names
and module paths (`layers.8.attention.wq` -> `layers.16.attention.wq`), the stage's place, and
the parameters' init (which a model may scale by depth: the model's spec gives it exactly).

Nothing here assumes it holds: builder/build.py traces the first and the last stage of such a
run for real and uses relabeled programs for the ones between only when the first relabeled to
the last equals the last's own trace, document for document (else it traces them all).
"""

from __future__ import annotations

import json
import re

import msgpack

from titan.builder.program.bind import same_value
from titan.runtime.contract.graph_doc import read_doc
from titan.runtime.contract.rank_record import StagePlace
from titan.runtime.store.build_cache import Cache

_LAYER = re.compile(r"^layers\.(\d+)(?=\.|$)")


def _relabel(value, shift: int):
    """`value` with every string that names a block (`layers.<i>...`) naming block i + shift."""
    if isinstance(value, str):
        return _LAYER.sub(lambda m: f"layers.{int(m.group(1)) + shift}", value)
    if isinstance(value, list):
        return [_relabel(v, shift) for v in value]
    if isinstance(value, dict):
        return {_relabel(k, shift): _relabel(v, shift) for k, v in value.items()}
    return value


def _graph(cache: Cache, sha: str, shift: int) -> dict:
    return _relabel(read_doc(cache.read_blob(sha)), shift)


def _meta(cache: Cache, program: dict, shift: int, *, stage: StagePlace, init_specs: dict[str, dict]) -> dict:
    meta = _relabel(json.loads(cache.read_blob(program["meta"])), shift)
    meta["stage"] = dict(meta["stage"], index=stage.index, layers=list(stage.layers))
    meta["params"] = [dict(p, init=init_specs[p["fqn"]]) for p in meta["params"]]
    return meta


def relabeled_programs(cache: Cache, programs: list[dict], *, shift: int, stage: StagePlace,
                       init_specs: dict[str, dict]) -> list[dict]:
    """A stage's stored programs (their blobs put into `cache`) as the programs of `stage`, whose
    blocks are `shift` further on."""
    out = []
    for program in programs:
        graphs = {kind: cache.put_blob(msgpack.packb(_graph(cache, program[kind], shift), use_bin_type=True))
                  for kind in ("forward", "backward")}
        meta = _meta(cache, program, shift, stage=stage, init_specs=init_specs)
        meta.update(forward_graph=graphs["forward"], backward_graph=graphs["backward"])
        out.append(dict(program, **graphs, meta=cache.put_blob(json.dumps(meta, indent=1).encode())))
    return out


def relabels_exactly(cache: Cache, source: list[dict], target: list[dict], *, shift: int, stage: StagePlace,
                     init_specs: dict[str, dict]) -> bool:
    """Whether `source`'s programs relabeled by `shift` are `target`'s (a stage traced for real)."""
    if len(source) != len(target):
        return False
    for a, b in zip(source, target):
        if a["bindings"] != b["bindings"]:
            return False
        for kind in ("forward", "backward"):
            if not same_value(_graph(cache, a[kind], shift), read_doc(cache.read_blob(b[kind]))):
                return False
        mine = _meta(cache, a, shift, stage=stage, init_specs=init_specs)
        theirs = json.loads(cache.read_blob(b["meta"]))
        graphs = {k: theirs.get(k) for k in ("forward_graph", "backward_graph")}
        if not same_value(dict(mine, **graphs), theirs):
            return False
    return True
