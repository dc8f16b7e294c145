"""titan-build's memory report of a pipeline artifact: per pp rank, its stages' parameter state
(fp32 parameters, gradients and AdamW's two moments, as traced: sharded over the stage's tp x
dp-shard ranks), the parameters each stage holds gathered for the step (titan-run's default:
runtime/stage_gather.py) and saved activations times the micro-batches each stage holds at once
in the schedule, and whether that fits the GPUs people train on."""

from __future__ import annotations

from titan.runtime.contract.artifact import Artifact
from titan.runtime.contract.memory_estimate import GIB, PARAM_STATE_BYTES, param_elements

GPUS = (("an 80 GiB GPU", 80), ("a 141 GiB GPU", 141))


def pipeline_memory_lines(art: Artifact) -> list[str]:
    schedule = art.manifest.pipeline.schedule
    per_block = art.world_size // art.layout.pp
    lines = ["memory per rank (parameter state + parameters gathered once per step + saved activations x the "
             "micro-batches each stage holds at its peak; workspace not counted):"]
    gathered_any = False
    for pp in range(art.layout.pp):
        rank = pp * per_block
        state = gathered = activations = 0
        parts = []
        for s in art.manifest.stages_of(rank):
            record = art.rank_record(rank, stage=s)
            held = schedule.in_flight(s)
            state += param_elements(record) * PARAM_STATE_BYTES
            # What the forward saved of the gathered parameters is the step's one gathered copy.
            per_microbatch = record.saved_bytes - record.stage.gathered_saved_bytes
            gathered += record.stage.gathered_bytes
            activations += per_microbatch * held
            held_once = f"{record.stage.gathered_bytes / GIB:.2f} GiB gathered + " if record.stage.gathered_bytes else ""
            parts.append(f"stage {s} {held_once}{per_microbatch / GIB:.2f} GiB x {held}")
        gathered_any |= gathered > 0
        total = (state + gathered + activations) / GIB
        fits = ", ".join(f"{'fits' if total <= size else 'does not fit'} {name}" for name, size in GPUS)
        lines.append(f"  pp rank {pp}: {state / GIB:.2f} GiB parameter state + "
                     + (f"{gathered / GIB:.2f} GiB gathered parameters + " if gathered else "")
                     + f"{activations / GIB:.2f} GiB activations ({'; '.join(parts)}) = {total:.2f} GiB: {fits}")
    if gathered_any:
        lines.append("  (gathered: each stage's parameters all-gathered once per step and held from its first forward "
                     "to its last backward, titan-run's default; --no-pp-gather-per-step gathers them in every "
                     "micro-batch instead, held per micro-batch in flight where the forward saves them)")
    return lines
