"""Each pipeline rank's ordered actions for one step, computed at build time and stored as data
(runtime/contract/pipeline_schedule.py). With V stages per rank (interleaved 1F1B), stage s runs
on pp rank s % pp (rank r holds stages r, r + pp, ...); with zbv, rank r holds stages r and
2 pp - 1 - r (a V); otherwise stage s runs on pp rank s (stage_ranks).

The compute order is that of torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B and ScheduleZBVZeroBubble (tests/unit/test_pipeline_schedule.py compares
them). Transfers sit next to the compute they serve: a stage receives a micro-batch's activations
just before its forward and sends its output right after; gradients the same way round the
backward (B, or zbv's I; W transfers nothing). zbv places its receives otherwise: its
neighbouring stages on one rank (the turn of the V) hand over in memory, with no transfer, and
each pair of its ranks exchanges two streams each way (rank r feeds stage r + 1 forward and
stage 2 pp - 2 - r backward), whose receives, placed just before their compute, would come in
another order than their sends; so they are placed as torch places them (lockstep_transfers),
as soon as the peer sends. The runtime posts sends without waiting, so a receive only waits for a
send its peer has already reached (PipelineSchedule.check proves it, and that each pair of ranks
receives in the order it sends).
"""

from __future__ import annotations

from collections import defaultdict

from titan.runtime.contract.pipeline_schedule import Action, PipelineSchedule, SCHEDULES, stage_ranks


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


def zbv_order(rank: int, *, pp: int, microbatches: int) -> list[tuple[int, str, int] | None]:
    """(stage, F, I or W, micro-batch) in the order pp rank `rank` runs them in ZB-V (Qi et al.
    2024, "Zero Bubble Pipeline Parallelism", section 6), as torch's ScheduleZBVZeroBubble builds it:
    the rank holds stages r (chunk 0) and 2 pp - 1 - r (chunk 1). A warm-up of chunk-0 forwards,
    then of both chunks, then chunk 1's forward, I and W in turn; the steady state alternates a
    forward, I and W on each chunk; the cool-down runs the remaining I's (the bubble the other
    ranks' I's leave) and then every W still owed. It is laid out for at least 2 pp - 1
    micro-batches; with fewer, the actions of the micro-batches that do not exist are dropped.
    None marks an idle step (it places the receives: lockstep_transfers)."""
    n = max(2 * pp - 1, microbatches)
    chunk0, chunk1 = rank, 2 * pp - 1 - rank
    counts = defaultdict(int)  # (stage, kind) -> the next micro-batch
    order: list[tuple[int, str, int] | None] = [None] * rank  # idle steps: the V's first forward is on its way

    def run(stage: int, *kinds: str) -> None:
        for kind in kinds:
            order.append((stage, kind, counts[stage, kind]))
            counts[stage, kind] += 1

    for _ in range(2 * (pp - rank) - 1):
        run(chunk0, "F")
    for _ in range(rank):
        run(chunk1, "F")
        run(chunk0, "F")
    for _ in range(pp - rank):
        run(chunk1, "F", "I", "W")
    while counts[chunk1, "F"] < counts[chunk0, "F"] or counts[chunk0, "F"] < n:
        if counts[chunk0, "F"] < n:
            run(chunk0, "F")
        run(chunk0, "I", "W")
        run(chunk1, "F", "I", "W")
    for _ in range(rank):
        run(chunk0, "I")
        run(chunk1, "I")
    for _ in range(pp - rank):
        run(chunk0, "I", "W")
    for stage in (chunk1, chunk0):
        while counts[stage, "W"] < counts[stage, "I"]:
            run(stage, "W")
    return [a if a is None or a[2] < microbatches else None for a in order]


def with_transfers(order: list[tuple[int, str, int]], *, stages: int) -> list[Action]:
    """The compute order (F and B, neighbouring stages on other ranks) with each receive just
    before and each send just after its compute."""
    actions = []
    for stage, kind, m in order:
        first, last = stage == 0, stage == stages - 1
        before = {"F": () if first else ("RECV_F",), "B": () if last else ("RECV_B",)}[kind]
        after = {"F": () if last else ("SEND_F",), "B": () if first else ("SEND_B",)}[kind]
        actions += [Action(stage, k, m) for k in (*before, kind, *after)]
    return actions


def lockstep_transfers(orders: list[list[tuple[int, str, int] | None]], *,
                       stage_rank: tuple[int, ...]) -> list[list[Action]]:
    """Each rank's compute order with its transfers, placed as torch's _add_send_recv places them:
    the ranks advance in lock step, one compute each per round (None: an idle step) once what it
    needs has come; a send goes right after its compute, and its receive is appended to the
    receiver's actions at the same moment. So every rank receives from a peer in the order the
    peer sends, and a receive is waited for only once its send is posted."""
    stages = len(stage_rank)
    actions: list[list[Action]] = [[] for _ in orders]
    done: list[set[tuple[str, int, int]]] = [set() for _ in orders]
    at = [0] * len(orders)

    def ready(r: int, stage: int, kind: str, m: int) -> bool:
        if kind == "F" and stage > 0:
            return ("RECV_F", stage, m) in done[r] or ("F", stage - 1, m) in done[r]
        if kind in ("B", "I") and stage < stages - 1:
            return ("RECV_B", stage, m) in done[r] or (kind, stage + 1, m) in done[r]
        return True

    while any(a < len(order) for a, order in zip(at, orders)):
        progress = False
        for r, order in enumerate(orders):
            if at[r] == len(order):
                continue
            if order[at[r]] is not None:
                stage, kind, m = order[at[r]]
                if not ready(r, stage, kind, m):
                    continue
                actions[r].append(Action(stage, kind, m))
                done[r].add((kind, stage, m))
                target = stage + 1 if kind == "F" else stage - 1
                if kind in ("F", "B", "I") and 0 <= target < stages and stage_rank[target] != r:
                    send, recv = ("SEND_F", "RECV_F") if kind == "F" else ("SEND_B", "RECV_B")
                    actions[r].append(Action(stage, send, m))
                    actions[stage_rank[target]].append(Action(target, recv, m))
                    done[stage_rank[target]].add((recv, target, m))
            at[r] += 1
            progress = True
        assert progress, "a compute order whose ranks wait on each other"
    return actions


def pipeline_schedule(schedule: str, *, spans: tuple[tuple[int, int], ...], microbatches: int,
                      stages_per_rank: int = 1) -> PipelineSchedule:
    """The checked schedule for stages holding `spans` of layers, `stages_per_rank` per pp rank."""
    assert schedule in SCHEDULES and (stages_per_rank > 1) == (schedule in ("interleaved-1f1b", "zbv"))
    stages = len(spans)
    pp = stages // stages_per_rank
    assert pp * stages_per_rank == stages
    placement = stage_ranks(schedule, stages=stages, pp=pp)
    assert placement is not None
    if schedule == "zbv":
        actions = lockstep_transfers([zbv_order(r, pp=pp, microbatches=microbatches) for r in range(pp)],
                                     stage_rank=placement)
        return _checked(schedule, spans=spans, microbatches=microbatches, placement=placement, actions=actions)
    if schedule == "interleaved-1f1b":
        orders = [interleaved_order(r, pp=pp, stages_per_rank=stages_per_rank, microbatches=microbatches)
                  for r in range(pp)]
    else:
        orders = [[(s, kind, m) for kind, m in compute_order(schedule, stage=s, stages=stages,
                                                             microbatches=microbatches)] for s in range(stages)]
    return _checked(schedule, spans=spans, microbatches=microbatches, placement=placement,
                    actions=[with_transfers(order, stages=stages) for order in orders])


def _checked(schedule: str, *, spans, microbatches: int, placement: tuple[int, ...],
             actions: list[list[Action]]) -> PipelineSchedule:
    record = PipelineSchedule(schedule=schedule, microbatches=microbatches, stage_layers=spans, stage_rank=placement,
                              actions=tuple(map(tuple, actions)))
    record.check("pipeline schedule", n_layers=spans[-1][1])
    return record
