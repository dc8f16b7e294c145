"""Each pipeline rank's ordered actions for one step, computed at build time and stored as data
(runtime/contract/pipeline_schedule.py). One stage per rank: stage s runs on pp rank s.

The compute order is that of torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B
(tests/unit/test_pipeline_schedule.py compares them). Transfers sit next to the compute they
serve: a stage receives a micro-batch's activations just before its forward and sends its output
right after; gradients the same way round the backward. The runtime posts sends without waiting,
so a receive only waits for a send its peer has already reached (PipelineSchedule.check proves it).
"""

from __future__ import annotations

from titan.runtime.contract.pipeline_schedule import Action, PipelineSchedule, SCHEDULES


def compute_order(schedule: str, *, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """(F or B, micro-batch) in the order stage `stage` runs them."""
    if schedule == "gpipe":
        return [("F", m) for m in range(microbatches)] + [("B", m) for m in range(microbatches)]
    assert schedule == "1f1b" and microbatches >= stages
    warmup = stages - 1 - stage
    order = [("F", m) for m in range(warmup)]
    for m in range(microbatches - warmup):  # steady state: one forward, then the oldest backward
        order += [("F", warmup + m), ("B", m)]
    return order + [("B", m) for m in range(microbatches - warmup, microbatches)]


def with_transfers(order: list[tuple[str, int]], *, stage: int, stages: int) -> list[Action]:
    """The compute order with each receive just before and each send just after its compute."""
    first, last = stage == 0, stage == stages - 1
    actions = []
    for kind, m in order:
        before = {"F": () if first else ("RECV_F",), "B": () if last else ("RECV_B",)}[kind]
        after = {"F": () if last else ("SEND_F",), "B": () if first else ("SEND_B",)}[kind]
        actions += [Action(stage, k, m) for k in (*before, kind, *after)]
    return actions


def pipeline_schedule(schedule: str, *, spans: tuple[tuple[int, int], ...], microbatches: int) -> PipelineSchedule:
    """The checked schedule for stages holding `spans` of layers, one stage per pp rank."""
    assert schedule in SCHEDULES
    stages = len(spans)
    record = PipelineSchedule(
        schedule=schedule, microbatches=microbatches, stage_layers=spans, stage_rank=tuple(range(stages)),
        actions=tuple(tuple(with_transfers(compute_order(schedule, stage=s, stages=stages, microbatches=microbatches),
                                           stage=s, stages=stages)) for s in range(stages)))
    record.check("pipeline schedule", n_layers=spans[-1][1])
    return record
