"""titan-build's memory report of a pipeline artifact: per pp rank, its stages' parameter state
(fp32 parameters, gradients and AdamW's two moments, as traced: sharded over the stage's tp x
dp-shard ranks) and saved activations times the micro-batches each stage holds at once in the
schedule, and whether that fits the GPUs people train on."""

from __future__ import annotations

from titan.runtime.contract.artifact import Artifact
from titan.runtime.contract.memory_estimate import GIB, PARAM_STATE_BYTES, param_elements

GPUS = (("an 80 GiB GPU", 80), ("a 141 GiB GPU", 141))


def pipeline_memory_lines(art: Artifact) -> list[str]:
    schedule = art.manifest.pipeline.schedule
    per_block = art.world_size // art.layout.pp
    lines = ["memory per rank (parameter state + saved activations x the micro-batches each stage holds at its "
             "peak; workspace not counted):"]
    for pp in range(art.layout.pp):
        rank = pp * per_block
        state = activations = 0
        parts = []
        for s in art.manifest.stages_of(rank):
            record = art.rank_record(rank, stage=s)
            held = schedule.in_flight(s)
            state += param_elements(record) * PARAM_STATE_BYTES
            activations += record.saved_bytes * held
            parts.append(f"stage {s} {record.saved_bytes / GIB:.2f} GiB x {held}")
        total = (state + activations) / GIB
        fits = ", ".join(f"{'fits' if total <= size else 'does not fit'} {name}" for name, size in GPUS)
        lines.append(f"  pp rank {pp}: {state / GIB:.2f} GiB parameter state + {activations / GIB:.2f} GiB activations "
                     f"({'; '.join(parts)}) = {total:.2f} GiB: {fits}")
    return lines
