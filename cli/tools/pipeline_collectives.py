"""How many collectives one step of a pipeline rank's stages issues, each stage with its
parameters gathered once per step (titan-run's default, runtime/stage_gather.py), in every
micro-batch (--no-pp-gather-per-step, the stage graphs as stored) and with its gradients also
reduced once per step (--pp-reduce-per-step, runtime/stage_reduce.py): titan-show's summary."""

from __future__ import annotations

import torch

from titan.runtime.contract.artifact import Artifact
from titan.runtime.rank_graphs import load_rank_graphs
from titan.runtime.stage_gather import count_collectives, gather_once
from titan.runtime.stage_reduce import reduce_once


def _add(*counts: dict[str, int], times: int = 1) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for kind, n in c.items():
            out[kind] = out.get(kind, 0) + n * times
    return out


def stage_collectives(art: Artifact, rank: int, stage: int
                      ) -> tuple[dict[str, int], dict[str, int], dict[str, int] | str]:
    """(per step with the gather once per step, with a gather in every micro-batch, with the
    reduce once per step too) of `rank`'s `stage`: collectives of each kind; the last is the
    reason instead where the stage cannot reduce once per step."""
    record = art.rank_record(rank, stage=stage)
    groups = {dim: dim for dim, _ in art.layout.mesh_shape()}
    forward, backward = load_rank_graphs(art, rank, device=torch.device("cpu"), groups=groups, stage=stage)
    m = art.manifest.pipeline.schedule.microbatches
    cut = gather_once(forward, backward, n_params=len(record.params))
    once = _add(count_collectives(cut.gather), _add(count_collectives(cut.forward), count_collectives(cut.backward),
                                                    times=m))
    every = _add(count_collectives(forward), count_collectives(backward), times=m)
    try:
        reduced = reduce_once(cut.backward, n_params=len(record.params), groups=groups)
    except ValueError as refused:
        return once, every, str(refused)
    both = once if reduced is None else _add(
        count_collectives(cut.gather), count_collectives(reduced.reduce),
        _add(count_collectives(cut.forward), count_collectives(reduced.compute), times=m))
    return once, every, both


def pipeline_collective_lines(art: Artifact, rank: int) -> list[str]:
    def fmt(counts: dict[str, int]) -> str:
        return ", ".join(f"{n} {kind}{'' if n == 1 else 's'}" for kind, n in sorted(counts.items())) or "none"

    m = art.manifest.pipeline.schedule.microbatches
    lines = [f"collectives per step on this rank ({m} micro-batches; the pipeline's transfers not counted):"]
    for s in art.manifest.stages_of(rank):
        once, every, both = stage_collectives(art, rank, s)
        lines.append(f"  stage {s}: {fmt(once)} (parameters gathered once per step: titan-run's default); "
                     f"{fmt(every)} (gathered in every micro-batch: --no-pp-gather-per-step); "
                     + (f"{fmt(both)} (gradients reduced once per step too: --pp-reduce-per-step)"
                        if isinstance(both, dict) else both))
    return lines
