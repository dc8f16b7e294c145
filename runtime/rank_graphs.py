"""A rank's two graphs, read from the artifact, bound to the rank and checked against its
metadata: the load step of titan-run, and a load-only check of every rank of an artifact
(no process group: a mesh dimension's group is named by the dimension)."""

from __future__ import annotations

import torch
import torch.fx as fx

from titan.runtime.contract.artifact import Artifact
from titan.runtime.contract.graph_decode import load_graph, region_kinds
from titan.runtime.contract.graph_doc import MAX_GRAPH_BYTES
from titan.runtime.contract.rank_record import check_graphs


def load_rank_graphs(artifact: Artifact, rank: int, *, device: torch.device, groups: dict[str, str],
                     redo: bool = False, stage: int | None = None) -> tuple[fx.GraphModule, fx.GraphModule]:
    """(forward, backward) of `rank`, its rank-specific values bound to its coordinates;
    `groups` maps mesh dimensions to this process's process-group names; `redo`: of its
    dropless redo program (a bounded MoE artifact's); `stage`: of one of its pipeline stages."""
    entry = artifact.rank_entry(rank, redo=redo, stage=stage)
    regions = region_kinds(artifact.manifest.passes)  # fusion regions only if the build made them
    bind = dict(groups=groups, coords=artifact.rank_coordinates(rank), device=device, regions=regions)
    forward = load_graph(artifact.read_verified(entry.forward, max_size=MAX_GRAPH_BYTES), **bind)
    backward = load_graph(artifact.read_verified(entry.backward, max_size=MAX_GRAPH_BYTES), **bind)
    where = f"{artifact.root} rank {rank}{' redo program' if redo else ''}{'' if stage is None else f' stage {stage}'}"
    check_graphs(artifact.rank_record(rank, redo=redo, stage=stage), forward, backward, where, rank=rank,
                 layout=artifact.layout,
                 graph_hashes={k: artifact.graph_hash(rank, k, redo=redo, stage=stage) for k in ("forward", "backward")},
                 batch_shape=(artifact.manifest.batch_size, artifact.manifest.seq_len),
                 vocab_size=artifact.manifest.vocab_size)
    return forward, backward


def check_rank_loads(artifact: Artifact, rank: int) -> None:
    """Everything titan-run checks of `rank` before it binds process groups: its metadata, its
    graphs decoded with every bound, and the two checked against each other."""
    groups = {dim: dim for dim, _ in artifact.layout.mesh_shape()}
    for stage in artifact.manifest.stages_of(rank) or (None,):
        load_rank_graphs(artifact, rank, device=torch.device("cpu"), groups=groups, stage=stage)
        if artifact.manifest.redo_programs:
            load_rank_graphs(artifact, rank, device=torch.device("cpu"), groups=groups, redo=True, stage=stage)
