"""Each pipeline rank's ordered actions for one step, computed at build time and stored as data
(runtime/contract/pipeline_schedule.py). With V stages per rank (interleaved 1F1B), stage s runs
on pp rank s % pp (rank r holds stages r, r + pp, ...); otherwise stage s runs on pp rank s.

The compute order is that of torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B and
ScheduleInterleaved1F1B (tests/unit/test_pipeline_schedule.py compares them). Transfers sit next
to the compute they serve: a stage receives a micro-batch's activations just before its forward
and sends its output right after; gradients the same way round the backward. The runtime posts
sends without waiting, so a receive only waits for a send its peer has already reached
(PipelineSchedule.check proves it, and that each pair of ranks receives in the order it sends).
"""

from __future__ import annotations

from collections import defaultdict

from titan.runtime.contract.pipeline_schedule import Action, PipelineSchedule, SCHEDULES


def compute_order(schedule: str, *, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """(F or B, micro-batch) in the order stage `stage` runs them, one stage per rank."""
    if schedule == "gpipe":
        return [("F", m) for m in range(microbatches)] + [("B", m) for m in range(microbatches)]
    assert schedule == "1f1b" and microbatches >= stages
    warmup = stages - 1 - stage
    order = [("F", m) for m in range(warmup)]
    for m in range(microbatches - warmup):  # steady state: one forward, then the oldest backward
        order += [("F", warmup + m), ("B", m)]
    return order + [("B", m) for m in range(microbatches - warmup, microbatches)]


def interleaved_rounds(pp: int, microbatches: int) -> tuple[int, int]:
    """(rounds, micro-batches per round) of interleaved 1F1B: a rank runs `per round` micro-batches
    through one of its stages before moving to the next."""
    rounds = max(1, microbatches // pp)
    return rounds, microbatches // rounds


def interleaved_order(rank: int, *, pp: int, stages_per_rank: int, microbatches: int) -> list[tuple[int, str, int]]:
    """(stage, F or B, micro-batch) in the order pp rank `rank` runs them in interleaved 1F1B
    (Narayanan et al. 2021, depth first, with torch's flexible rounds): a warm-up of forwards long
    enough for the first backward to reach the rank, then one forward and one backward, then the
    remaining backwards."""
    v = stages_per_rank
    rounds, per_round = interleaved_rounds(pp, microbatches)
    assert microbatches % rounds == 0
    total = microbatches * v
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), total)
    forwards, backwards = defaultdict(int), defaultdict(int)
    order = []
    for op in range(total + warmup):
        if op < total:  # forwards go through the rank's stages first to last, a round at a time
            s = (op // per_round) % v * pp + rank
            order.append((s, "F", forwards[s]))
            forwards[s] += 1
        if op >= warmup:  # backwards last to first
            s = (v - 1 - (op - warmup) // per_round % v) * pp + rank
            order.append((s, "B", backwards[s]))
            backwards[s] += 1
    return order


def with_transfers(order: list[tuple[int, str, int]], *, stages: int) -> list[Action]:
    """The compute order with each receive just before and each send just after its compute."""
    actions = []
    for stage, kind, m in order:
        first, last = stage == 0, stage == stages - 1
        before = {"F": () if first else ("RECV_F",), "B": () if last else ("RECV_B",)}[kind]
        after = {"F": () if last else ("SEND_F",), "B": () if first else ("SEND_B",)}[kind]
        actions += [Action(stage, k, m) for k in (*before, kind, *after)]
    return actions


def pipeline_schedule(schedule: str, *, spans: tuple[tuple[int, int], ...], microbatches: int,
                      stages_per_rank: int = 1) -> PipelineSchedule:
    """The checked schedule for stages holding `spans` of layers, `stages_per_rank` per pp rank."""
    assert schedule in SCHEDULES and (stages_per_rank > 1) == (schedule == "interleaved-1f1b")
    stages = len(spans)
    pp = stages // stages_per_rank
    assert pp * stages_per_rank == stages
    if schedule == "interleaved-1f1b":
        orders = [interleaved_order(r, pp=pp, stages_per_rank=stages_per_rank, microbatches=microbatches)
                  for r in range(pp)]
    else:
        orders = [[(s, kind, m) for kind, m in compute_order(schedule, stage=s, stages=stages,
                                                             microbatches=microbatches)] for s in range(stages)]
    record = PipelineSchedule(schedule=schedule, microbatches=microbatches, stage_layers=spans,
                              stage_rank=tuple(s % pp for s in range(stages)),
                              actions=tuple(tuple(with_transfers(order, stages=stages)) for order in orders))
    record.check("pipeline schedule", n_layers=spans[-1][1])
    return record
